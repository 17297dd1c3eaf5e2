"""What the colocated demo measures beside its loop: a sleep check before training (the
device memory a sleep frees, as the trainer's process sees it, and answers unchanged over a
sleep and a wake), and the worker's host memory after every cycle (a sleep that parks the
weights in host memory, or a leak, shows there)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_fleet.wiring.demo.run import DemoFailed, DemoSettings


def free_device_mib() -> float:
    """The device's free memory as this (the trainer's) process sees it."""
    import torch

    return torch.cuda.mem_get_info()[0] / 2**20


def host_memory_mib(pid: int) -> float:
    """Resident memory of the worker process and every process under it (its engine core)."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:  # gone between the listing and the reading
            continue
    return total / 2**20


def sleep_check(generation, prompts, settings: DemoSettings, run_dir: Path, *,
                engine_mib: float, reload: Callable[[], Any]) -> dict[str, Any]:
    """Before training: greedy answers, a sleep at the demo's level with the device's free
    memory read before, asleep and woken, then the same answers again. After a level-2 sleep
    the engine wakes without weights: ``reload`` refits the trainer's (unchanged) ones between
    the weights' wake and the KV cache's."""
    awake = free_device_mib()
    before = _greedy(generation, prompts, settings)
    generation.finish_generation()
    asleep = free_device_mib()
    if settings.sleep_level >= 2:
        generation.prepare_for_generation(tags=["weights"])
        reload()
        generation.prepare_for_generation(tags=["kv_cache"])
    else:
        generation.prepare_for_generation()
    woken = free_device_mib()
    after = _greedy(generation, prompts, settings)
    return {"level": settings.sleep_level,
            "sleep_freed_mib": asleep - awake, "wake_took_mib": asleep - woken,
            "engine_mib": engine_mib, "kv_cache_mib": kv_cache_mib(run_dir / "worker-0.log"),
            "answers_equal_after_wake": sum(a[0] == b[0] for a, b in zip(before, after)),
            "answers": len(before),
            "max_dlogprob_after_wake": max(
                (abs(x - y) for a, b in zip(before, after) for x, y in zip(a[1], b[1])),
                default=0.0)}


def check_sleep(figures: dict[str, Any]) -> None:
    if figures["answers_equal_after_wake"] != figures["answers"]:
        raise DemoFailed(f"after a sleep and a wake, {figures['answers_equal_after_wake']} of "
                         f"{figures['answers']} greedy answers equal those before it (same weights)")


def kv_cache_mib(worker_log: Path) -> float | None:
    """The KV cache vLLM allocated, from its worker's log line (None if it printed none)."""
    found = re.findall(r"Available KV cache memory: ([0-9.]+) GiB", _log_text(worker_log))
    return float(found[-1]) * 1024 if found else None


def cuda_graphs_line(worker_log: Path) -> str | None:
    """vLLM's own line saying it captured its CUDA graphs (None: it logged none, as an eager
    engine does)."""
    found = re.findall(r"Graph capturing finished in [^\n]*", _log_text(worker_log))
    return found[-1].strip() if found else None


def _log_text(worker_log: Path) -> str:
    return worker_log.read_text(errors="replace") if worker_log.exists() else ""


def sleep_line(figures: dict[str, Any]) -> str:
    kv, engine = figures["kv_cache_mib"], figures.get("engine_mib")
    shares = []
    if engine:
        shares.append(f"{figures['sleep_freed_mib'] / engine:.0%} of the {engine:,.0f} MiB the "
                      "engine took at its start")
    shares.append(f"{figures['sleep_freed_mib'] / kv:.0%} of the {kv:,.0f} MiB KV cache vLLM "
                  "allocated" if kv else "vLLM's KV cache size not found in its log")
    refit = " and a refit of the same weights" if figures.get("level", 1) >= 2 else ""
    return (f"sleep check: a level-{figures.get('level', 1)} sleep freed "
            f"{figures['sleep_freed_mib']:,.0f} MiB of the device = {'; '.join(shares)} (this "
            f"process's torch.cuda.mem_get_info), the wake took back "
            f"{figures['wake_took_mib']:,.0f} MiB; greedy answers after the wake{refit} equal "
            f"those before: {figures['answers_equal_after_wake']} of {figures['answers']} (max "
            f"|dlogprob| {figures['max_dlogprob_after_wake']:.1e})")


def host_memory_line(steps: list[dict[str, Any]]) -> str:
    """The worker's host memory over the cycles: first, last, peak and growth."""
    series = [s["worker_host_mib"] for s in steps]
    return (f"worker host memory (worker and engine core, resident) after each of {len(series)}"
            f" cycles: first {series[0]:,.0f} MiB, last {series[-1]:,.0f} MiB, peak "
            f"{max(series):,.0f} MiB, growth {series[-1] - series[0]:+,.0f} MiB")


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
