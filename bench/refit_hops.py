"""The per-hop figures a refit rests on, measured on this machine: what the cluster model
(bench/refit_cluster_model.py) predicts a refit to 8..1024 workers from.

    .venv/bin/python bench/refit_hops.py [--out out/scale/hops.json]

Between processes of a real gloo group on loopback, as a refit uses it:
  latency_s            one way, a 1-element send and its answer (ping-pong), halved: median
  bandwidth_Bps        a stream of pieces from one process to another, receives posted ahead as
  piece_overhead_s     the relay posts them: the time per piece t(c) at c = 64 KiB .. 4 MiB,
                       fitted by t(c) = overhead + c / bandwidth (least squares)
  header_per_worker_s  the trainer's CPU per worker in the header exchange (up the first relay
                       tree and back down): its slope between 1 and --header-ranks workers
And from the driver's own control client (HttpWorkerControl, aiohttp) to a small local server:
  control_per_worker_s the driver's CPU per control call when it calls many workers at once
                       (each worker's handling runs on that worker, not here)
  control_round_s      one control call's round trip (median)
Prints the figures and writes them as JSON (the model's --hops input).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
STREAM_BYTES = 128 << 20
IN_FLIGHT = 8
PING_REPS = 300


# -- gloo between processes ------------------------------------------------------------------
def _group(port: int, rank: int, world: int):
    from rollout_fleet.adapters.collective import init_group

    return init_group("127.0.0.1", port, rank, world, "gloo", 60.0)


def _pair_member(port: int, rank: int, results) -> None:
    import torch

    group = _group(port, rank, 2)
    peer = 1 - rank
    token = torch.zeros(1, dtype=torch.int64)
    rounds = []
    for _ in range(PING_REPS):
        started = time.perf_counter()
        if rank == 0:
            group.wait(group.send(token, peer), "ping")
            group.wait(group.recv(token, peer), "pong")
        else:
            group.wait(group.recv(token, peer), "ping")
            group.wait(group.send(token, peer), "pong")
        rounds.append(time.perf_counter() - started)
    per_piece = {}
    for chunk in CHUNKS:
        block = torch.ones(STREAM_BYTES, dtype=torch.uint8)
        pieces = [block[i:i + chunk] for i in range(0, STREAM_BYTES, chunk)]
        best = float("inf")
        for _ in range(3):
            group.wait(group.all_reduce_sum(torch.zeros(1)), "start")
            started = time.perf_counter()
            works = []
            for piece in pieces:
                works.append(group.send(piece, peer) if rank == 0 else group.recv(piece, peer))
                if len(works) >= IN_FLIGHT:
                    group.wait(works.pop(0), "piece")
            for work in works:
                group.wait(work, "piece")
            group.wait(group.all_reduce_sum(torch.zeros(1)), "end")
            best = min(best, time.perf_counter() - started)
        per_piece[chunk] = best / len(pieces)
    group.close()
    if rank == 0:
        results.put({"latency_s": statistics.median(rounds) / 2, "per_piece_s": per_piece})


def _header_member(port: int, rank: int, world: int, reps: int, results) -> None:
    from rollout_fleet.adapters.collective.wire import rows_of_every_rank

    group = _group(port, rank, world)
    row = [rank] * 9
    for _ in range(20):
        rows_of_every_rank(group, row, "warm")
    started = time.process_time()
    for _ in range(reps):
        rows_of_every_rank(group, row, "header")
    if rank == 0:
        results.put((time.process_time() - started) / reps)
    group.close()


def _run(target, members: list[tuple]) -> list:
    from rollout_fleet.adapters.shared import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=target, args=(port, *args, results)) for args in members]
    for process in processes:
        process.start()
    got = [results.get(timeout=300) for _ in range(1)]
    for process in processes:
        process.join(60)
    return got


def pair_figures() -> dict:
    found = _run(_pair_member, [(0,), (1,)])[0]
    sizes = sorted(found["per_piece_s"])
    xs, ys = sizes, [found["per_piece_s"][c] for c in sizes]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return {"latency_s": found["latency_s"], "bandwidth_Bps": 1.0 / slope,
            "piece_overhead_s": max(0.0, mean_y - slope * mean_x),
            "per_piece_s": {str(c): t for c, t in found["per_piece_s"].items()}}


def header_per_worker(workers: int, reps: int = 200) -> dict:
    costs = {}
    for n in (1, workers):
        world = n + 1
        costs[n] = _run(_header_member, [(rank, world, reps) for rank in range(world)])[0]
    return {"header_per_worker_s": max(0.0, (costs[workers] - costs[1]) / (workers - 1)),
            "header_trainer_cpu_s": {str(n): c for n, c in costs.items()}}


# -- the driver's control client -------------------------------------------------------------
def _control_server(port_queue) -> None:
    from aiohttp import web

    async def answer(request):
        await request.read()
        return web.json_response({"weight_version": 0})

    async def serve():
        app = web.Application()
        app.router.add_post("/engine/control/{name}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_queue.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(serve())


def control_figures(workers: int = 256, rounds: int = 5) -> dict:
    from rollout_fleet.adapters.http.control import HttpWorkerControl
    from rollout_fleet.core.fanout import call_everywhere

    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=_control_server, args=(ports,), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{ports.get(timeout=60)}"
        controls = [HttpWorkerControl(f"w{i}", url, secret="s") for i in range(workers)]
        one = controls[:1]

        async def measure() -> dict:
            await call_everywhere(controls, "weight_version", {}, 30.0)  # connections opened
            singles = []
            for _ in range(50):
                started = time.perf_counter()
                await call_everywhere(one, "weight_version", {}, 30.0)
                singles.append(time.perf_counter() - started)
            cpu = []
            for _ in range(rounds):
                started = time.process_time()
                await call_everywhere(controls, "weight_version", {}, 30.0)
                cpu.append((time.process_time() - started) / workers)
            return {"control_per_worker_s": statistics.median(cpu),
                    "control_round_s": statistics.median(singles)}

        return asyncio.run(measure())
    finally:
        server.kill()
        server.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the figures here as JSON")
    parser.add_argument("--header-ranks", type=int, default=8)
    args = parser.parse_args(argv)
    figures = {**pair_figures(), **header_per_worker(args.header_ranks), **control_figures()}
    print(f"per-hop latency {figures['latency_s'] * 1e6:.0f} us; link {figures['bandwidth_Bps'] / 1e9:.2f}"
          f" GB/s; per-piece overhead {figures['piece_overhead_s'] * 1e6:.0f} us; header at the "
          f"trainer {figures['header_per_worker_s'] * 1e6:.1f} us per worker; the driver's CPU "
          f"{figures['control_per_worker_s'] * 1e6:.0f} us per control call, a call's round trip "
          f"{figures['control_round_s'] * 1e3:.2f} ms")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
