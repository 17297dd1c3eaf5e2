"""Where a vLLM worker's host process spends its CPU per rollout: cProfile over timed batches.

The fleet of ``bench_vllm_frontend.py`` (the tiny model, one vLLM engine served through Dynamo
from this process, a real ``dynamo.frontend`` child, a client process of its own), warmed, then
``--rounds`` batches of ``--shape`` profiled. The worker's Python work (Dynamo's Python glue, the
project's Dynamo and vLLM adapters, the annotation parsing of core, vLLM's AsyncLLM front that
collects the engine core's outputs) runs on this process's main thread, profiled on that
thread's CPU clock; what the process spent beyond it ran in other threads (Dynamo's Rust
runtime: HTTP request plane, TCP response streams; vLLM's and torch's threads). Both are
printed beside vLLM's engine-core processes, the frontend and the client, per 1,000 tokens.

Each function's own time goes to a bucket by its module (standard-library and built-in
functions to their callers', in proportion: see ``profile_driver.charge``). Profiling slows
Python calls several-fold: read the shares inside the main thread, and the process figures from
a run without ``--profile`` beside them.

    .venv/bin/python bench/profile_worker.py [--shape 64x32] [--rounds 3] [--functions 3]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_vllm_frontend as frontend_bench  # noqa: E402
from profile_driver import charge  # noqa: E402

BUCKETS = ["Dynamo glue (dynamo's Python)", "project: Dynamo adapter", "project: core (annotations, checks)",
           "project: vLLM engine adapter", "vLLM AsyncLLM front (outputs, IPC)",
           "event loop (asyncio)", "bench harness", "other"]
RULES = [  # (bucket, path fragment): the first match wins
    ("project: Dynamo adapter", "/adapters/dynamo/"),
    ("project: vLLM engine adapter", "/adapters/vllm/"),
    ("project: core (annotations, checks)", "/core/"),
    ("project: core (annotations, checks)", "<attrs generated"),
    ("bench harness", "/bench/"),
    ("Dynamo glue (dynamo's Python)", "/dynamo/"),
    ("vLLM AsyncLLM front (outputs, IPC)", "/vllm/"),
    ("vLLM AsyncLLM front (outputs, IPC)", "/zmq/"),
    ("vLLM AsyncLLM front (outputs, IPC)", "msgspec"),
    ("event loop (asyncio)", "/asyncio/"),
    ("event loop (asyncio)", "/selectors.py"),
    ("event loop (asyncio)", "select.epoll"),
    ("event loop (asyncio)", "_asyncio."),
]


def worker_bucket(func: tuple[str, int, str]) -> str | None:
    filename, _line, name = func
    where = filename if filename != "~" else name
    for bucket, fragment in RULES:
        if fragment in where:
            return bucket
    return None


async def profile_rounds(run_dir: Path, shape: tuple[int, int], rounds: int):
    from rollout_fleet.adapters.tiny_model import build_tiny_model
    from rollout_fleet.adapters.vllm.host import VllmEngineConfig

    config = VllmEngineConfig(model=str(build_tiny_model(run_dir / "model", seed=0)))
    fleet = await frontend_bench.Fleet(run_dir, config).start()
    meter = frontend_bench.CpuMeter()
    try:
        await frontend_bench.warm(fleet, "fleet", [shape])
        profile = cProfile.Profile(time.thread_time)
        tokens, client_cpu = 0, 0.0
        before, thread_before = meter.snapshot(fleet.frontend.process.pid), time.thread_time()
        for index in range(rounds):
            profile.enable()
            _elapsed, answers, _note = await fleet.run(*shape, f"profile-{index}")
            profile.disable()
            tokens += sum(len(t) for t in answers)
            client_cpu += fleet.client_cpu_s
        after, main_thread = meter.snapshot(fleet.frontend.process.pid), time.thread_time() - thread_before
    finally:
        await fleet.close()
    spent = {part: after[part] - before[part] for part in after} | {"client": client_cpu}
    return profile, spent, main_thread, tokens


def print_breakdown(profile, spent: dict, main_thread: float, tokens: int, functions: int) -> None:
    per_k = 1e6 / tokens  # seconds -> ms per 1,000 tokens
    host = spent["caller/host"]
    print(f"{tokens} tokens; CPU ms per 1k tokens: worker host process {host * per_k:.0f} "
          f"(main thread {main_thread * per_k:.0f}, other threads {(host - main_thread) * per_k:.0f}), "
          f"engine core {spent['engine core'] * per_k:.0f}, frontend {spent['frontend'] * per_k:.0f}, "
          f"client {spent['client'] * per_k:.0f}  (profiled: Python calls run slower)")
    seconds, by_function = charge(pstats.Stats(profile).stats, worker_bucket)
    total = sum(seconds.values())
    print(f"  main thread of the worker host, by step   {'share':>6s}   biggest functions in it")
    for bucket in BUCKETS:
        biggest = sorted(by_function[bucket].items(), key=lambda kv: -kv[1])[:functions]
        named = ", ".join(f"{name} {s / total:.1%}" for name, s in biggest)
        print(f"  {bucket:42s} {seconds.get(bucket, 0.0) / total:6.1%}   {named}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="64x32", help="prompts x new tokens (default 64x32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--functions", type=int, default=3, help="functions named per step")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be in [1, 20]")
    shape = frontend_bench.parse_shape(args.shape)
    signal.signal(signal.SIGTERM, lambda *_: None)  # as bench_vllm_frontend: Dynamo's stops on it
    with tempfile.TemporaryDirectory(prefix="profile-worker-") as run_dir:
        result = asyncio.run(profile_rounds(Path(run_dir), shape, args.rounds))
    print_breakdown(*result, args.functions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
