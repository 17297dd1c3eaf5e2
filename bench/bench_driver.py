"""Driver cost per rollout: this project's rollout client against the HTTP floors.

One run, one real Dynamo frontend and in-memory-engine workers on loopback, clients measured
in interleaved rounds (the order rotates each round), medians printed with the ratios:

  (a)  this project's driver: FleetGeneration.generate_async (tensors in, build the request,
       send through the pooled client with retries, parse, assemble the contract's tensors)
  (a') the same driver on the httpx API over httpx-aiohttp's transport (the runner-up stack)
  (b)  the floor: a bare pooled aiohttp POST loop, same concurrency, same body bytes, json.loads
  (c)  a new aiohttp session per request (upstream's way)
  (d)  httpx's AsyncClient on its default transport, pooled

Targets: (a) >= 0.9x the rollouts/s of (b); CPU per rollout <= 1.3x (b) and <= 0.7x (c).
Ratios are printed on the medians and on each client's best run (other processes on a shared
machine only add CPU time and take throughput away).
Driver CPU is this process's CPU time (the frontend and workers are other processes). The
long-lived heap (torch, Dynamo, the fleet handles) is frozen out of the garbage collector before
measuring: otherwise a full collection over it (120-320 ms here, a cost of the heap and not of
any client) lands on whichever run happened to trigger it. Full collections are still counted
per client and printed.

    .venv/bin/python bench/bench_driver.py [--requests 1000] [--concurrency 64 256] [--rounds 3]
        [--clients a b]   (only those clients; the ratios that need another one are left out)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import torch  # noqa: E402

from rollout_fleet.adapters.http import HttpSettings  # noqa: E402
from rollout_fleet.adapters.nemo_rl import GenerationConfig  # noqa: E402
from rollout_fleet.core.rollout import RolloutRequest  # noqa: E402
from rollout_fleet.core.wire import REQUEST_ID_HEADER, completion_body  # noqa: E402
from rollout_fleet.wiring.driver import build_generation  # noqa: E402
from local_fleet import SERVED_MODEL, start_local_fleet, stop_local_fleet  # noqa: E402

MAX_NEW_TOKENS = 16
MAX_MODEL_LEN = 128


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 47) for _ in range(rng.randint(8, 24))] for _ in range(count)]


def as_batch(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = torch.tensor(p)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])}


def wire_bodies(prompts, tag: str) -> list[tuple[str, bytes]]:
    """The exact bodies the driver sends (greedy, same budget), pre-encoded for the floors."""
    out = []
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        body = completion_body(RolloutRequest(rid, p, MAX_NEW_TOKENS), SERVED_MODEL)
        out.append((rid, json.dumps(body, separators=(",", ":")).encode()))
    return out


async def gated(concurrency: int, count: int, one) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def run(i):
        async with gate:
            await one(i)
    await asyncio.gather(*(run(i) for i in range(count)))


def check_answer(status: int, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    json.loads(body)


# -- the clients: each returns (seconds, cpu seconds) for len(prompts) rollouts -------------------
async def run_driver(fleet, prompts, concurrency, client_kind):
    config = GenerationConfig(model=SERVED_MODEL, max_model_len=MAX_MODEL_LEN,
                              max_new_tokens=MAX_NEW_TOKENS, max_in_flight=concurrency)
    generation = build_generation(
        config, frontend_url=fleet.frontend_url, control_secret=fleet.secret,
        workers=fleet.endpoints(),
        http=HttpSettings(max_in_flight=concurrency, client=client_kind))
    warm, data = as_batch(prompts[:concurrency]), as_batch(prompts)
    async for _ in generation.generate_async(warm, greedy=True):
        pass
    t0, c0 = time.perf_counter(), time.process_time()
    got = 0
    async for _index, _sample in generation.generate_async(data, greedy=True):
        got += 1
    elapsed = time.perf_counter() - t0, time.process_time() - c0
    assert got == len(prompts)
    await generation._transport.aclose()  # this loop's pool; shutdown() would use its helper loop
    generation.shutdown()
    return elapsed


def bare_post(session, url: str, bodies):
    """(b)'s one request: POST the i-th prepared body and check the answer, nothing else."""
    async def one(i):
        rid, body = bodies[i]
        async with session.post(url, data=body, headers={
                "content-type": "application/json", REQUEST_ID_HEADER: rid}) as answer:
            check_answer(answer.status, await answer.read())
    return one


async def run_bare_pooled(fleet, prompts, concurrency, _kind=None):
    url = fleet.frontend_url + "/v1/completions"
    bodies = wire_bodies(prompts, "bare")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        one = bare_post(session, url, bodies)
        await gated(concurrency, concurrency, one)  # warm the pool
        t0, c0 = time.perf_counter(), time.process_time()
        await gated(concurrency, len(bodies), one)
        return time.perf_counter() - t0, time.process_time() - c0


async def run_session_per_request(fleet, prompts, concurrency, _kind=None):
    url = fleet.frontend_url + "/v1/completions"
    bodies = wire_bodies(prompts, "fresh")

    async def one(i):
        rid, body = bodies[i]
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=body, headers={
                    "content-type": "application/json", REQUEST_ID_HEADER: rid}) as answer:
                check_answer(answer.status, await answer.read())
    await gated(concurrency, concurrency, one)
    t0, c0 = time.perf_counter(), time.process_time()
    await gated(concurrency, len(bodies), one)
    return time.perf_counter() - t0, time.process_time() - c0


async def run_httpx_default(fleet, prompts, concurrency, _kind=None):
    url = fleet.frontend_url + "/v1/completions"
    bodies = wire_bodies(prompts, "httpx")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        async def one(i):
            rid, body = bodies[i]
            answer = await client.post(url, content=body, headers={
                "content-type": "application/json", REQUEST_ID_HEADER: rid})
            check_answer(answer.status_code, answer.content)
        await gated(concurrency, concurrency, one)
        t0, c0 = time.perf_counter(), time.process_time()
        await gated(concurrency, len(bodies), one)
        return time.perf_counter() - t0, time.process_time() - c0


CLIENTS = {
    "a  driver (pooled aiohttp)": (run_driver, "aiohttp"),
    "a' driver (httpx-aiohttp)": (run_driver, "httpx-aiohttp"),
    "b  bare pooled aiohttp": (run_bare_pooled, None),
    "c  session per request": (run_session_per_request, None),
    "d  httpx default transport": (run_httpx_default, None),
}
BY_LETTER = {name.split()[0]: name for name in CLIENTS}  # "a", "a'", "b", ...


def measure(fleet, requests: int, concurrency: int, rounds: int, deadline: float,
            names: list[str]):
    prompts = make_prompts(requests)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            if time.monotonic() > deadline:
                print(f"  time budget spent; stopping after round {round_index}", flush=True)
                return results
            run, kind = CLIENTS[name]
            full_before = gc.get_stats()[2]["collections"]
            seconds, cpu = asyncio.run(run(fleet, prompts, concurrency, kind))
            FULL_COLLECTIONS[name] = FULL_COLLECTIONS.get(name, 0) + \
                gc.get_stats()[2]["collections"] - full_before
            results[name].append((requests / seconds, cpu / requests * 1e6))
    return results


FULL_COLLECTIONS: dict[str, int] = {}


def report(results, concurrency: int, requests: int) -> dict[str, float]:
    rows_of = {name: rows for name, rows in results.items() if rows}
    median = {name: (statistics.median(r for r, _ in rows), statistics.median(c for _, c in rows))
              for name, rows in rows_of.items()}
    # Other processes only ever add CPU time and take throughput away: the best run of each
    # client is the least disturbed estimate of its own cost. Both are printed.
    best = {name: (max(r for r, _ in rows), min(c for _, c in rows)) for name, rows in rows_of.items()}
    print(f"\nconcurrency {concurrency}, {requests} rollouts per run, "
          f"{min(len(r) for r in rows_of.values())} interleaved rounds:")
    print(f"  {'client':30s} {'rollouts/s':>17s} {'CPU us/rollout':>17s}   "
          f"runs (rollouts/s / us)")
    print(f"  {'':30s} {'median':>8s} {'best':>8s} {'median':>8s} {'best':>8s}")
    for name, rows in rows_of.items():
        runs = ", ".join(f"{r:.0f}/{c:.0f}" for r, c in rows)
        print(f"  {name:30s} {median[name][0]:8.0f} {best[name][0]:8.0f} "
              f"{median[name][1]:8.0f} {best[name][1]:8.0f}   {runs}")
    print(f"  full GC collections so far: {FULL_COLLECTIONS}")
    a, a2, b, c, d = ("a  driver (pooled aiohttp)", "a' driver (httpx-aiohttp)",
                      "b  bare pooled aiohttp", "c  session per request", "d  httpx default transport")
    checks = [("a/b rollouts/s", (a, b), lambda m: m[a][0] / m[b][0], ">=", 0.9),
              ("a/b CPU", (a, b), lambda m: m[a][1] / m[b][1], "<=", 1.3),
              ("a/c CPU", (a, c), lambda m: m[a][1] / m[c][1], "<=", 0.7),
              ("a'/b CPU", (a2, b), lambda m: m[a2][1] / m[b][1], None, None),
              ("d/b CPU", (d, b), lambda m: m[d][1] / m[b][1], None, None)]
    ratios = {}
    print(f"  {'ratio':16s} {'median':>7s} {'best':>7s}")
    for key, needs, ratio, op, bound in checks:
        if not all(name in median for name in needs):
            continue
        on_median, on_best = ratio(median), ratio(best)
        ratios[key] = on_median
        verdict = ""
        if op is not None:
            met = [(v >= bound) if op == ">=" else (v <= bound) for v in (on_median, on_best)]
            verdict = (f"  target {op} {bound}: median {'met' if met[0] else 'MISSED'}, "
                       f"best {'met' if met[1] else 'MISSED'}")
        print(f"  {key:16s} {on_median:6.2f}x {on_best:6.2f}x{verdict}")
    return ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--time-budget-s", type=float, default=600.0)
    parser.add_argument("--clients", nargs="+", choices=sorted(BY_LETTER), default=sorted(BY_LETTER),
                        help="which clients to run (by letter; a' is the httpx-aiohttp driver)")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 20000 or not 1 <= args.rounds <= 10:
        parser.error("--requests must be in [1, 20000] and --rounds in [1, 10]")
    deadline = time.monotonic() + args.time_budget_s
    with tempfile.TemporaryDirectory(prefix="bench-driver-") as run_dir:
        fleet = start_local_fleet(Path(run_dir), num_workers=args.workers)
        gc.collect()
        gc.freeze()
        try:
            print(f"Dynamo frontend {fleet.frontend_url}, {args.workers} in-memory workers, "
                  f"{MAX_NEW_TOKENS} tokens per rollout, prompts of 8-24 tokens")
            for concurrency in args.concurrency:
                names = [BY_LETTER[letter] for letter in sorted(set(args.clients))]
                report(measure(fleet, args.requests, concurrency, args.rounds, deadline, names),
                       concurrency, args.requests)
        finally:
            stop_local_fleet(fleet)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
