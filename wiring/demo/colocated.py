"""The colocated demo: the GRPO loop of the demo with the trainer and one vLLM worker on one
device, taking turns as colocated RL does. Each step: wake the engine, generate, put it to
sleep, train, wake its weights, refit it from the trainer's own buffers (shared memory on
the CPU, CUDA IPC on a GPU), and again.

On a GPU the engine sleeps between phases (vLLM's sleep mode: level 1 frees the KV cache and
parks the weights in host memory, level 2 frees both and the refit after the weights' wake
loads every weight); vLLM has no sleep mode on the CPU, so there the worker stays awake and
the demo says so. Every step prints its sleep, wake and refit seconds and the worker's host
memory. With ``in_place`` the trainer's parameters live in the sender's buffers, so a refit is
the engine's one copy out of them.
"""

from __future__ import annotations

import time
from typing import Any

from rollout_fleet.wiring.demo.colocated_checks import (
    check_sleep,
    cuda_graphs_line,
    free_device_mib,
    host_memory_line,
    host_memory_mib,
    sleep_check,
    sleep_line,
)
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


def run_colocated_demo(settings: DemoSettings, device: str = "cpu") -> list[dict[str, Any]]:
    import torch
    from rollout_fleet.core.device import Device
    from rollout_fleet.wiring.fleet import Fleet

    torch.set_num_threads(1)  # the worker needs the cores more than the tiny trainer does
    device = Device.parse(device, "device")
    on_gpu = device is Device.GPU  # vLLM sleeps only there
    print(f"starting one colocated {settings.engine} worker on the {device} ...", flush=True)
    started = time.perf_counter()
    free_before = free_device_mib() if on_gpu else 0.0
    fleet = Fleet.start(_config(settings, device))
    generation = loop = None
    try:
        engine_mib = free_before - free_device_mib() if on_gpu else 0.0
        sleeping = f"level {settings.sleep_level}" if on_gpu else \
            "off (vLLM has no sleep mode on the CPU)"
        print(f"fleet up in {time.perf_counter() - started:.1f} s; sleep between phases: "
              f"{sleeping}", flush=True)
        graphs = cuda_graphs_line(fleet.run_dir / "worker-0.log") if on_gpu else None
        if on_gpu:
            print(f"CUDA graphs: {graphs or 'none captured (vLLM logged no capture)'}", flush=True)
        generation = fleet.generation()
        loop = ColocatedLoop(fleet, generation, settings, device.torch_type)
        slept = sleep_check(generation, loop.prompts, settings, fleet.run_dir,
                            engine_mib=engine_mib, reload=loop.refit) if on_gpu else None
        if slept:
            print(sleep_line(slept), flush=True)
        steps = loop.run()
        if slept:  # checked after the loop, so one run gives every figure
            check_sleep(slept)
            steps[0].update(sleep_check=slept, cuda_graphs=graphs)
    finally:
        shut_down(fleet, generation, loop and loop.sender)
    return write_figures(steps, settings)


class ColocatedLoop:
    """The trainer, its sender to the one worker and the steps: each a whole colocated cycle."""

    def __init__(self, fleet, generation, settings: DemoSettings, device: str) -> None:
        from rollout_fleet.wiring.colocated_trainer import colocated_sender
        from rollout_fleet.wiring.demo.trainer import PolicyTrainer, TargetTokenReward

        self.generation, self.settings = generation, settings
        self.worker_pid = fleet.workers[0].pid
        self.trainer = PolicyTrainer(fleet.model_path, learning_rate=settings.learning_rate,
                                     seed=settings.seed, device=device, dtype=settings.dtype)
        vocab = self.trainer.model.config.vocab_size
        self.reward = TargetTokenReward(vocab, seed=settings.seed)
        self.prompts = demo_prompts(settings, vocab)
        self.sender = colocated_sender(fleet.worker_control(0), device=device,
                                       buffer_bytes=int(settings.buffer_mib * 2**20),
                                       num_buffers=2, timeout_s=300)
        if settings.in_place:  # before the optimizer's first step: its state follows
            self.sender.make_resident(self.trainer.parameters())
        self.version = 0

    def refit(self) -> Any:
        weights = self.trainer.parameters() if self.settings.in_place else self.trainer.state_dict()
        result = self.sender.send({name: t.detach() for name, t in weights.items()})
        self.version += 1
        if result.weight_version != self.version:
            raise DemoFailed(f"refit {self.version}: the colocated refit set weight version "
                             f"{result.weight_version}, expected {self.version}")
        return result

    def run(self) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = []
        started = time.perf_counter()
        for step in range(1, self.settings.steps + 1):
            figures = self._step(step)
            steps.append(figures)
            print(_row(figures, self.settings), flush=True)
        print_summary(steps, time.perf_counter() - started, self.settings)
        print(host_memory_line(steps), flush=True)
        for figures in steps:  # after the loop, so one run gives every figure
            _check(figures, figures["step"], self.settings)
        return steps

    def _step(self, step: int) -> dict[str, Any]:
        """One colocated cycle; the phases' seconds beside the batch's figures."""
        generation, settings = self.generation, self.settings
        wake_s = _timed(generation.prepare_for_generation)
        scored, seconds = scored_rollouts(generation, self.prompts, settings, self.reward)
        figures = batch_figures(step, scored, seconds, self.trainer)
        sleep_s = _timed(generation.finish_generation)
        figures["loss"] = self.trainer.step(scored, settings.group_size)
        wake_s += _timed(lambda: generation.prepare_for_generation(tags=["weights"]))
        result = self.refit()
        figures.update(wake_s=wake_s, sleep_s=sleep_s, refit_s=result.seconds,
                       refit_buckets=result.buckets, refit_pool_bytes=result.pool_bytes,
                       refit_bytes=result.nbytes, refit_moved_tensors=result.moved_tensors,
                       refit_load=load_kind(result.engine),
                       weight_versions=[result.weight_version],
                       worker_host_mib=host_memory_mib(self.worker_pid))
        return figures


def _config(settings: DemoSettings, device: str):
    from rollout_fleet.wiring.config import parse_config

    engine: dict[str, Any] = {"kind": settings.engine, "dtype": settings.dtype}
    if device == "gpu":
        engine.update(gpu_memory_utilization=0.3)
    return parse_config({
        "engine": engine, "num_workers": 1, "model": settings.model, "device": device,
        "placement": "local", "served_model_name": "demo",
        "max_new_tokens": settings.max_new_tokens, "max_model_len": 512,
        "colocation": {"enabled": device == "gpu", "sleep_level": settings.sleep_level},
        "timeouts": {"start_s": 600, "refit_s": 300}})


def load_kind(engine_stats: dict[str, Any]) -> str:
    """How the engine loaded an in-place refit: its first load recorded, replayed after
    (``adapters/vllm/inside/load_replay.py``), or why not."""
    if engine_stats.get("replayed"):
        return "replayed"
    refusal = engine_stats.get("replay_refusal")
    return f"not replayed ({refusal})" if refusal else "recorded"


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _row(figures: dict[str, Any], settings: DemoSettings) -> str:
    how = (f"in place: {figures['refit_buckets']} buckets of the trainer's own parameters,"
           f" the load {figures['refit_load']}" if settings.in_place else f"{figures['refit_buckets']} buckets through 2 buffers of"
           f" {figures['refit_pool_bytes'] / 2 / 2**20:.1f} MiB")
    return (f"step {figures['step']}: reward {figures['mean_reward']:.3f}, mismatch max "
            f"{figures['mismatch_max']:.1e}, {figures['tokens_per_s']:,.0f} tokens/s; sleep "
            f"{figures['sleep_s']:.2f} s, wake {figures['wake_s']:.2f} s, refit "
            f"{figures['refit_s']:.2f} s ({how}), weight version "
            f"{figures['weight_versions'][0]}; worker host memory "
            f"{figures['worker_host_mib']:,.0f} MiB")


def _check(figures: dict[str, Any], step: int, settings: DemoSettings) -> None:
    if settings.in_place and figures["refit_moved_tensors"]:
        raise DemoFailed(f"step {step}: {figures['refit_moved_tensors']} of the trainer's "
                         "parameters left the sender's buffers (an in-place refit copies them)")
    if figures["mismatch_max"] > settings.mismatch_bound:
        raise DemoFailed(f"step {step}: train/inference logprob mismatch "
                         f"{figures['mismatch_max']:.2e} exceeds {settings.mismatch_bound:.0e}")
