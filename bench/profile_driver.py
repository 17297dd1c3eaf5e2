"""Where the driver's CPU goes per rollout: cProfile over one timed batch of bench_driver's (a),
then over one of its floor (b), the bare pooled aiohttp loop, for comparison.

The same fleet as ``bench_driver.py`` (a real Dynamo frontend, in-memory workers on loopback),
the same driver call (``FleetGeneration.generate_async``, greedy, 16 new tokens), profiled with
cProfile on this process's CPU clock (``time.process_time``), after a warm-up batch. Each
function's own time goes to a bucket: by the function's module and name where it belongs to one
step of a rollout, else (the standard library, built-ins: json, len, ...) to its callers' buckets
in proportion to what each caller spent in it, up the graph to the nearest step.

Profiling slows every Python call by a similar factor, so the shares, not the absolute
microseconds, are the result; C work (socket calls, json's scanner) is cheap under it and its
share is somewhat understated next to Python code.

    .venv/bin/python bench/profile_driver.py [--requests 1000] [--concurrency 64] [--functions 3] [--top 0]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_driver import MAX_MODEL_LEN, MAX_NEW_TOKENS, as_batch, make_prompts  # noqa: E402

# Buckets in the order they are printed; each rule: (bucket, path fragment, function names or None).
BUCKETS = ["request building", "validation (attrs value objects)", "HTTP (aiohttp, yarl, multidict)",
           "event loop + sockets (asyncio)", "parsing the answer", "NeMo-RL tensor assembly",
           "rollout client + retries", "driver loop (generate_async, queue)", "other"]
RULES = [
    ("request building", "/core/wire.py", {"completion_body", "encode_rollout_annotation", "_json"}),
    ("request building", "/adapters/http/pool.py", {"dumps"}),
    ("request building", "msgspec.json.Encoder", None),
    ("request building", "/adapters/nemo_rl/generation.py", {"_requests", "_seeded_for"}),
    ("request building", "/core/rollout_client.py", {"request"}),
    ("request building", "/adapters/nemo_rl/batch.py", {"read_batch"}),
    ("parsing the answer", "/core/wire.py", None),
    ("parsing the answer", "/adapters/http/transport.py",
     {"read_answer", "read_completion_answer", "served_or_none"}),
    ("parsing the answer", "msgspec.json.Decoder", None),
    ("validation (attrs value objects)", "/core/rollout.py", None),
    ("validation (attrs value objects)", "/core/validate.py", None),
    ("validation (attrs value objects)", "<attrs generated", None),
    ("validation (attrs value objects)", "/adapters/nemo_rl/generation.py", {"_check_result"}),
    ("validation (attrs value objects)", "/adapters/nemo_rl/batch.py", {"check_prompts"}),
    ("NeMo-RL tensor assembly", "/adapters/nemo_rl/batch.py", None),
    ("NeMo-RL tensor assembly", "/torch/", None),
    ("NeMo-RL tensor assembly", "torch.", None),  # built-in torch methods
    ("HTTP (aiohttp, yarl, multidict)", "/aiohttp/", None),
    ("HTTP (aiohttp, yarl, multidict)", "/yarl/", None),
    ("HTTP (aiohttp, yarl, multidict)", "/multidict/", None),
    ("HTTP (aiohttp, yarl, multidict)", "/aiohappyeyeballs/", None),
    ("HTTP (aiohttp, yarl, multidict)", "/adapters/http/", None),
    ("HTTP (aiohttp, yarl, multidict)", "aiohttp", None),  # compiled aiohttp built-ins
    ("event loop + sockets (asyncio)", "/asyncio/", None),
    ("event loop + sockets (asyncio)", "/selectors.py", None),
    ("event loop + sockets (asyncio)", "_socket.socket", None),
    ("event loop + sockets (asyncio)", "select.epoll", None),
    ("event loop + sockets (asyncio)", "_asyncio.", None),
    ("rollout client + retries", "/core/rollout_client.py", None),
    ("rollout client + retries", "/core/retry.py", None),
    ("driver loop (generate_async, queue)", "/adapters/nemo_rl/generation.py", None),
    ("driver loop (generate_async, queue)", "/wiring/", None),
]


def bucket_of(func: tuple[str, int, str]) -> str | None:
    filename, _line, name = func
    where = filename if filename != "~" else name
    for bucket, fragment, names in RULES:
        if fragment in where and (names is None or name in names):
            return bucket
    return None  # generic: charged to its callers


def charge(stats: dict, bucket_of=bucket_of) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Seconds of own time per bucket (generic functions charged up to their callers), and
    per bucket the seconds of each function that landed there."""
    memo: dict = {}

    def shares(func, depth: int = 0) -> dict[str, float]:
        if func in memo:
            return memo[func]
        own = bucket_of(func)
        if own is not None:
            return {own: 1.0}
        callers = stats[func][4] if func in stats else {}
        weights = {caller: edge[2] + 1e-12 for caller, edge in callers.items()}
        total = sum(weights.values())
        if depth > 30 or not weights:
            return {"other": 1.0}
        memo[func] = {"other": 1.0}  # a cycle back here counts as other
        mixed: dict[str, float] = defaultdict(float)
        for caller, weight in weights.items():
            for bucket, share in shares(caller, depth + 1).items():
                mixed[bucket] += share * weight / total
        memo[func] = dict(mixed)
        return memo[func]

    seconds: dict[str, float] = defaultdict(float)
    by_function: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for func, (_cc, _nc, own_time, _ct, _callers) in stats.items():
        for bucket, share in shares(func).items():
            seconds[bucket] += own_time * share
            by_function[bucket][pstats.func_std_string(func).split("/")[-1]] += own_time * share
    return seconds, by_function


async def profiled_batch(fleet, requests: int, concurrency: int) -> tuple[cProfile.Profile, float, float]:
    from bench_driver import SERVED_MODEL, HttpSettings, build_generation
    from rollout_fleet.adapters.nemo_rl import GenerationConfig

    config = GenerationConfig(model=SERVED_MODEL, max_model_len=MAX_MODEL_LEN,
                              max_new_tokens=MAX_NEW_TOKENS, max_in_flight=concurrency)
    generation = build_generation(
        config, frontend_url=fleet.frontend_url, control_secret=fleet.secret,
        workers=fleet.endpoints(),
        http=HttpSettings(max_in_flight=concurrency, client="aiohttp"))
    prompts = make_prompts(requests)
    async for _ in generation.generate_async(as_batch(prompts[:concurrency]), greedy=True):
        pass
    data = as_batch(prompts)
    profile = cProfile.Profile(time.process_time)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    profile.enable()
    async for _ in generation.generate_async(data, greedy=True):
        pass
    profile.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await generation._transport.aclose()
    generation.shutdown()
    return profile, cpu, wall


async def profiled_floor(fleet, requests: int, concurrency: int) -> tuple[cProfile.Profile, float, float]:
    """bench_driver's (b), the bare pooled aiohttp loop, on the same bodies, profiled alike."""
    import aiohttp
    from bench_driver import bare_post, gated, wire_bodies

    url = fleet.frontend_url + "/v1/completions"
    bodies = wire_bodies(make_prompts(requests), "floor")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        one = bare_post(session, url, bodies)
        await gated(concurrency, concurrency, one)  # warm the pool
        profile = cProfile.Profile(time.process_time)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        profile.enable()
        await gated(concurrency, len(bodies), one)
        profile.disable()
        return profile, time.process_time() - cpu0, time.perf_counter() - wall0


def print_breakdown(title: str, profile, cpu: float, wall: float, args) -> None:
    stats = pstats.Stats(profile)
    seconds, by_function = charge(stats.stats)
    total = sum(seconds.values())
    print(f"{title}: {args.requests} rollouts at concurrency {args.concurrency}, profiled: "
          f"{cpu:.2f} s CPU in {wall:.2f} s = {cpu / args.requests * 1e6:.0f} us CPU per rollout "
          "(with profiling)")
    print(f"  {'step':36s} {'share':>6s} {'us/rollout':>11s}   biggest functions in it")
    for bucket in BUCKETS:
        biggest = sorted(by_function[bucket].items(), key=lambda kv: -kv[1])[:args.functions]
        named = ", ".join(f"{name} {spent / total:.1%}" for name, spent in biggest)
        print(f"  {bucket:36s} {seconds.get(bucket, 0.0) / total:6.1%} "
              f"{seconds.get(bucket, 0.0) / args.requests * 1e6:11.0f}   {named}")
    if args.top:
        print()
        stats.sort_stats("tottime").print_stats(args.top)


def main(argv=None) -> int:
    from local_fleet import start_local_fleet, stop_local_fleet

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--functions", type=int, default=3, help="functions named per step")
    parser.add_argument("--top", type=int, default=0, help="also print the top N functions by own time")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 20000:
        parser.error("--requests must be in [1, 20000]")
    with tempfile.TemporaryDirectory(prefix="profile-driver-") as run_dir:
        fleet = start_local_fleet(Path(run_dir), num_workers=args.workers)
        gc.collect()
        gc.freeze()
        try:
            driver_profile, *driver_run = asyncio.run(profiled_batch(fleet, args.requests, args.concurrency))
            floor_profile, *floor_run = asyncio.run(profiled_floor(fleet, args.requests, args.concurrency))
        finally:
            stop_local_fleet(fleet)
    print_breakdown("driver (a)", driver_profile, *driver_run, args)
    print()
    print_breakdown("floor (b), bare pooled aiohttp", floor_profile, *floor_run, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
