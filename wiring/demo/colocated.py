"""The colocated demo: the GRPO loop of the demo with the trainer and one vLLM worker on one
device, taking turns as colocated RL does. Each step: wake the engine, generate, put it to
sleep, train, wake its weights, refit it from the trainer's own buffers (shared memory on
the CPU, CUDA IPC on a GPU), and again.

On a GPU the engine sleeps between phases (vLLM's sleep mode, level 1: the KV cache goes back
to the trainer); vLLM has no sleep mode on the CPU, so there the worker stays awake and the
demo says so. Every step prints its sleep, wake and refit seconds.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from rollout_fleet.wiring.demo.run import (
    DemoFailed,
    DemoSettings,
    batch_figures,
    demo_prompts,
    scored_rollouts,
    print_summary,
    shut_down,
    write_figures,
)

BUFFER_BYTES = 1 << 20  # several buckets per refit even for the tiny model


def run_colocated_demo(settings: DemoSettings, device: str = "cpu") -> list[dict[str, Any]]:
    import torch
    from rollout_fleet.core.device import Device
    from rollout_fleet.wiring.demo.trainer import PolicyTrainer, TargetTokenReward
    from rollout_fleet.wiring.fleet import Fleet

    torch.set_num_threads(1)  # the worker needs the cores more than the tiny trainer does
    device = Device.parse(device, "device")
    on_gpu = device is Device.GPU  # vLLM sleeps only there
    print(f"starting one colocated {settings.engine} worker on the {device} ...", flush=True)
    started = time.perf_counter()
    fleet = Fleet.start(_config(settings, device))
    steps: list[dict[str, Any]] = []
    generation = sender = None
    try:
        print(f"fleet up in {time.perf_counter() - started:.1f} s; sleep between phases: "
              f"{'level 1' if on_gpu else 'off (vLLM has no sleep mode on the CPU)'}", flush=True)
        generation = fleet.generation()
        trainer = PolicyTrainer(fleet.model_path, learning_rate=settings.learning_rate,
                                seed=settings.seed, device=device.torch_type)
        reward = TargetTokenReward(trainer.model.config.vocab_size, seed=settings.seed)
        prompts = demo_prompts(settings, trainer.model.config.vocab_size)
        sender = fleet_sender(fleet, device.torch_type)
        slept = sleep_check(generation, prompts, settings, fleet.run_dir) if on_gpu else None
        if slept:
            print(_sleep_line(slept), flush=True)
        loop_started = time.perf_counter()
        for step in range(1, settings.steps + 1):
            figures = _step(step, generation, trainer, sender, prompts, settings, reward)
            steps.append(figures)
            print(_row(figures), flush=True)
            _check(figures, step, settings)
        print_summary(steps, time.perf_counter() - loop_started, settings)
        if slept:  # checked after the loop, so one run gives every figure
            _check_sleep(slept)
            steps[0]["sleep_check"] = slept
    finally:
        shut_down(fleet, generation, sender)
    return write_figures(steps, settings)


def fleet_sender(fleet: Any, device: str) -> Any:
    from rollout_fleet.wiring.colocated_trainer import colocated_sender

    return colocated_sender(fleet.worker_control(0), device=device, buffer_bytes=BUFFER_BYTES,
                            num_buffers=2, timeout_s=300)


def sleep_check(generation, prompts, settings: DemoSettings, run_dir: Path) -> dict[str, Any]:
    """Before training: greedy answers, a level-1 sleep with the device's free memory measured
    from this (the trainer's) process before, asleep and woken, then the same answers again."""
    import torch

    awake = torch.cuda.mem_get_info()[0]
    before = _greedy(generation, prompts, settings)
    generation.finish_generation()
    asleep = torch.cuda.mem_get_info()[0]
    generation.prepare_for_generation()
    woken = torch.cuda.mem_get_info()[0]
    after = _greedy(generation, prompts, settings)
    figures = {"sleep_freed_mib": (asleep - awake) / 2**20,
               "wake_took_mib": (asleep - woken) / 2**20,
               "kv_cache_mib": _kv_cache_mib(run_dir / "worker-0.log"),
               "answers_equal_after_wake": sum(a[0] == b[0] for a, b in zip(before, after)),
               "answers": len(before),
               "max_dlogprob_after_wake": max(
                   (abs(x - y) for a, b in zip(before, after) for x, y in zip(a[1], b[1])),
                   default=0.0)}
    return figures


def _check_sleep(figures: dict[str, Any]) -> None:
    if figures["answers_equal_after_wake"] != figures["answers"]:
        raise DemoFailed(f"after a sleep and a wake, {figures['answers_equal_after_wake']} of "
                         f"{figures['answers']} greedy answers equal those before it (same weights)")


def _kv_cache_mib(worker_log: Path) -> float | None:
    """The KV cache vLLM allocated, from its worker's log line (None if it printed none)."""
    found = re.findall(r"Available KV cache memory: ([0-9.]+) GiB",
                       worker_log.read_text(errors="replace") if worker_log.exists() else "")
    return float(found[-1]) * 1024 if found else None


def _greedy(generation, prompts, settings: DemoSettings) -> list[tuple[list[int], list[float]]]:
    import torch

    data = {"input_ids": torch.tensor(prompts, dtype=torch.long),
            "input_lengths": torch.full((len(prompts),), settings.prompt_len, dtype=torch.long)}
    answers: list = [None] * len(prompts)

    async def collect():
        async for index, sample in generation.generate_async(data, greedy=True):
            n, start = int(sample["generation_lengths"][0]), settings.prompt_len
            answers[index] = (sample["output_ids"][0, start:start + n].tolist(),
                              sample["logprobs"][0, start:start + n].tolist())

    asyncio.run(collect())
    return answers


def _sleep_line(figures: dict[str, Any]) -> str:
    kv = figures["kv_cache_mib"]
    share = (f" = {figures['sleep_freed_mib'] / kv:.0%} of the {kv:,.0f} MiB KV cache vLLM "
             "allocated" if kv else " (vLLM's KV cache size not found in its log)")
    return (f"sleep check: a level-1 sleep freed {figures['sleep_freed_mib']:,.0f} MiB of the "
            f"device{share} (this process's torch.cuda.mem_get_info), the wake took back "
            f"{figures['wake_took_mib']:,.0f} MiB; greedy answers after the wake equal those "
            f"before: {figures['answers_equal_after_wake']} of {figures['answers']} (max "
            f"|dlogprob| {figures['max_dlogprob_after_wake']:.1e})")


def _config(settings: DemoSettings, device: str):
    from rollout_fleet.wiring.config import parse_config

    engine: dict[str, Any] = {"kind": settings.engine}
    if device == "gpu":
        engine.update(gpu_memory_utilization=0.3, dtype="float32")
    return parse_config({
        "engine": engine, "num_workers": 1, "model": "tiny", "device": device,
        "placement": "local", "served_model_name": "tiny",
        "max_new_tokens": settings.max_new_tokens, "max_model_len": 512,
        "colocation": {"enabled": device == "gpu"},
        "timeouts": {"start_s": 600, "refit_s": 300}})


def _step(step: int, generation, trainer, sender, prompts, settings: DemoSettings, reward
          ) -> dict[str, Any]:
    """One colocated step; the phases' seconds beside the batch's figures."""
    wake_s = _timed(generation.prepare_for_generation)
    scored, seconds = scored_rollouts(generation, prompts, settings, reward)
    figures = batch_figures(step, scored, seconds, trainer)
    sleep_s = _timed(generation.finish_generation)
    figures["loss"] = trainer.step(scored, settings.group_size)
    wake_s += _timed(lambda: generation.prepare_for_generation(tags=["weights"]))
    result = sender.send(trainer.state_dict())
    figures.update(wake_s=wake_s, sleep_s=sleep_s, refit_s=result.seconds,
                   refit_buckets=result.buckets, refit_pool_bytes=result.pool_bytes,
                   refit_bytes=result.nbytes,
                   weight_versions=[result.weight_version])
    return figures


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _row(figures: dict[str, Any]) -> str:
    return (f"step {figures['step']}: reward {figures['mean_reward']:.3f}, mismatch max "
            f"{figures['mismatch_max']:.1e}, {figures['tokens_per_s']:,.0f} tokens/s; sleep "
            f"{figures['sleep_s']:.2f} s, wake {figures['wake_s']:.2f} s, refit "
            f"{figures['refit_s']:.2f} s ({figures['refit_buckets']} buckets through 2 buffers of "
            f"{figures['refit_pool_bytes'] / 2 / 2**20:.1f} MiB), weight version "
            f"{figures['weight_versions'][0]}")


def _check(figures: dict[str, Any], step: int, settings: DemoSettings) -> None:
    if figures["weight_versions"] != [step]:
        raise DemoFailed(f"step {step}: the colocated refit set weight version "
                         f"{figures['weight_versions']}, expected {step}")
    if figures["mismatch_max"] > settings.mismatch_bound:
        raise DemoFailed(f"step {step}: train/inference logprob mismatch "
                         f"{figures['mismatch_max']:.2e} exceeds {settings.mismatch_bound:.0e}")
