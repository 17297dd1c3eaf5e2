"""Load: thousands of rollouts in flight from one FleetGeneration over a local fleet.

One run, loopback only: 8 memory-engine workers (a per-token delay stands in for a GPU) behind
the real Dynamo frontend, for each router mode (round-robin, then Dynamo's KV router). For each,
two clients send the same bodies at the same concurrency (every rollout in flight at once),
interleaved, each in a fresh child process so its memory and sockets are its own:

  driver    this project's FleetGeneration.generate_async (one pooled client, retries,
            tensors in and out), from a fresh pool (``--warm``: then again on the warm pool)
  upstream  a new aiohttp session per request (the upstream NeMo-RL way), same bodies, parsed
            with the same wire parser

Printed per client: rollouts/s, the client's own CPU time per rollout, p50/p99 latency (batch
start to the rollout's result; all are sent at once), the child's peak RSS, RSS growth per
in-flight rollout (peak during the batch minus RSS just before it, over the rollouts in
flight), its open sockets (read from /proc/self/fd: the peak during the batch and the count
after it ended), and what the frontend itself answered (its Prometheus counters), so retried 5xx cannot hide. On 2 shared cores the
fleet (8 worker processes + the frontend) is the bottleneck; the client CPU is the driver's own.

The KV router's event sockets bind 0.0.0.0, so when it is asked for the whole bench re-executes
itself inside a private network namespace (unshare -n, loopback only).

``--nodes 3`` runs the same load against a fleet across nodes (as root): the 3-node layout of
support/node_layout.py (network namespaces joined by a bridge, `ray start` on each, 10.77.0.x),
the workers spread over nodes 2 and 3, etcd, the frontend and every client on the head; the
bench re-runs itself on the head and prints the same table.

    .venv/bin/python bench/bench_load.py [--rollouts 4096] [--workers 8] [--modes round-robin kv]
    .venv/bin/python bench/bench_load.py --nodes 3 --workers 4 --modes round-robin --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # support.node_layout

from support.node_layout import WORKER_RESOURCE, NodeLayout  # noqa: E402

MAX_NEW_TOKENS = 16
MAX_MODEL_LEN = 128
CLIENTS = ("driver", "upstream")


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 47) for _ in range(rng.randint(8, 24))] for _ in range(count)]


# -- what a child measures about itself ---------------------------------------------------------
class Sampler:
    """Peak RSS and peak open sockets of this process while a batch runs (every 20 ms)."""

    def __init__(self) -> None:
        self.peak_rss = own_rss_bytes()
        self.peak_sockets = own_open_sockets()
        self._task = None

    async def _run(self) -> None:
        while True:
            self.peak_rss = max(self.peak_rss, own_rss_bytes())
            self.peak_sockets = max(self.peak_sockets, own_open_sockets())
            await asyncio.sleep(0.02)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        self._task.cancel()
        self.peak_rss = max(self.peak_rss, own_rss_bytes())
        self.peak_sockets = max(self.peak_sockets, own_open_sockets())


async def batch_with_driver(spec: dict, prompts: list[list[int]]) -> dict:
    """One batch from a fresh driver (its pool opens its connections: cold), and with
    ``spec["warm"]`` a second that reuses them (as every later step of a training run does)."""
    import torch

    from rollout_fleet.adapters.http import HttpSettings
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation

    n = len(prompts)
    config = GenerationConfig(model=spec["model"], max_model_len=MAX_MODEL_LEN,
                              max_new_tokens=MAX_NEW_TOKENS, max_in_flight=n)
    generation = build_generation(
        config, frontend_url=spec["url"], control_secret=spec["secret"],
        workers=[WorkerEndpoint(name, url) for name, url in spec["workers"]],
        http=HttpSettings(max_in_flight=n))
    width = max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = torch.tensor(p)
    data = {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])}
    before = own_rss_bytes()
    sampler = Sampler()
    sampler.start()
    runs = {}
    for name in ("cold", "warm") if spec.get("warm") else ("cold",):
        latencies, seen = [], set()
        t0, cpu0 = time.perf_counter(), time.process_time()
        async for index, _sample in generation.generate_async(data, greedy=True):
            latencies.append(time.perf_counter() - t0)
            seen.add(index)
        assert seen == set(range(n)), "lost or duplicated rollouts"
        runs[name] = (latencies, time.process_time() - cpu0)
    sampler.stop()
    await generation._transport.aclose()  # this loop's pool
    generation.shutdown()
    return {"runs": runs, "sampler": sampler, "before": before}


async def batch_session_per_request(spec: dict, prompts: list[list[int]]
                                    ) -> dict:
    import aiohttp

    from rollout_fleet.core.rollout import RolloutRequest
    from rollout_fleet.core.wire import REQUEST_ID_HEADER, completion_body, parse_completion_answer

    url = spec["url"] + "/v1/completions"
    bodies = [(f"upstream-{i}", json.dumps(completion_body(
        RolloutRequest(f"upstream-{i}", p, MAX_NEW_TOKENS), spec["model"]),
        separators=(",", ":")).encode()) for i, p in enumerate(prompts)]
    t0 = 0.0
    latencies: list[float] = []

    async def one(rid: str, body: bytes) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            async with session.post(url, data=body, headers={
                    "content-type": "application/json", REQUEST_ID_HEADER: rid}) as answer:
                payload = await answer.read()
                if answer.status != 200:
                    raise RuntimeError(f"HTTP {answer.status}: {payload[:300]!r}")
                parse_completion_answer(payload)
        latencies.append(time.perf_counter() - t0)

    before = own_rss_bytes()
    sampler = Sampler()
    sampler.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(*b) for b in bodies))
    cpu = time.process_time() - cpu0
    sampler.stop()
    assert len(latencies) == len(prompts)
    return {"runs": {"cold": (latencies, cpu)}, "sampler": sampler, "before": before}


def child_main(spec_text: str) -> int:
    spec = json.loads(spec_text)
    prompts = make_prompts(spec["rollouts"], seed=spec["seed"])
    # Both clients load the same libraries, then freeze that long-lived heap out of the garbage
    # collector: otherwise full collections over torch's heap (100+ ms each, triggered by the
    # allocations of thousands of requests) land on whichever client runs, not on its own cost.
    import aiohttp  # noqa: F401
    import torch  # noqa: F401

    import rollout_fleet.adapters.nemo_rl  # noqa: F401
    import rollout_fleet.wiring.driver  # noqa: F401

    gc.collect()
    gc.freeze()
    run = batch_with_driver if spec["client"] == "driver" else batch_session_per_request
    measured = asyncio.run(run(spec, prompts))
    sampler, n = measured["sampler"], len(prompts)
    common = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_per_rollout_kib": (sampler.peak_rss - measured["before"]) / n / 1024,
        "peak_sockets": sampler.peak_sockets, "sockets_after": own_open_sockets(),
    }
    rows = {}
    for name, (latencies, cpu_s) in measured["runs"].items():
        latencies = sorted(latencies)
        rows[name] = {"rollouts_per_s": n / latencies[-1], "cpu_us": cpu_s / n * 1e6,
                      "p50_s": latencies[n // 2],
                      "p99_s": latencies[min(n - 1, int(n * 0.99))], **common}
    print(json.dumps(rows))
    return 0


def frontend_outcomes(url: str) -> dict[str, float]:
    """The frontend's own count of completions requests by status (its Prometheus metrics)."""
    import urllib.request

    counts: dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("dynamo_frontend_requests_total{") and 'endpoint="completions"' in line:
                status = line.split('status="', 1)[1].split('"', 1)[0]
                error = line.split('error_type="', 1)[1].split('"', 1)[0] if "error_type" in line else ""
                key = status + (f"/{error}" if error else "")
                counts[key] = counts.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return counts


# -- the parent: fleets, children, the table -----------------------------------------------------
ROWS = {"driver/cold": "driver, cold pool", "driver/warm": "driver, warm pool",
        "upstream/cold": "session per request"}
# Under thousands of requests in flight on 2 cores, a worker acknowledges a request later than
# Dynamo's default TCP request timeout (5 s) and the frontend answers 504: give it room.
FLEET_ENV = {"DYN_TCP_REQUEST_TIMEOUT": "120"}


def measure_mode(mode: str, args, deadline: float) -> dict[str, list[dict]]:
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    results: dict[str, list[dict]] = {key: [] for key in ROWS
                                      if args.warm or key != "driver/warm"}
    with tempfile.TemporaryDirectory(prefix=f"bench-load-{mode}-") as run_dir:
        started = time.monotonic()
        config = parse_config({
            "placement": "local", "num_workers": args.workers, "served_model_name": "mem",
            "engine": {"kind": "memory", "context_length": MAX_MODEL_LEN,
                       "token_delay_s": args.token_delay_s},
            "max_model_len": MAX_MODEL_LEN, "router": mode, "env": FLEET_ENV,
            "run_dir": run_dir, "timeouts": {"start_s": 180}, **cluster_settings(args)})
        with Fleet.start(config) as fleet:
            where = sorted({w.node_ip for w in fleet.workers})
            print(f"\n[{mode}] {args.workers} workers up in {time.monotonic() - started:.1f} s "
                  f"at {fleet.frontend_url} (workers on {', '.join(where)})", flush=True)
            spec = {"url": fleet.frontend_url, "secret": fleet.secret, "model": "mem",
                    "workers": [(w.worker_id, w.system_url) for w in fleet.endpoints()],
                    "rollouts": args.rollouts}
            for round_index in range(args.rounds):
                order = CLIENTS if round_index % 2 == 0 else CLIENTS[::-1]
                for client in order:
                    if time.monotonic() > deadline:
                        print("  time budget spent; skipping the rest", flush=True)
                        return results
                    child = {**spec, "client": client, "seed": round_index, "warm": args.warm}
                    outcomes_before = frontend_outcomes(fleet.frontend_url)
                    try:
                        done = subprocess.run(
                            [sys.executable, __file__, "--child", json.dumps(child)],
                            capture_output=True, text=True,
                            timeout=max(10.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        print(f"  {client}: time budget spent during its run; skipped", flush=True)
                        return results
                    if done.returncode != 0:
                        raise RuntimeError(f"{client} child failed:\n{done.stderr[-3000:]}")
                    outcomes = {k: v - outcomes_before.get(k, 0)
                                for k, v in frontend_outcomes(fleet.frontend_url).items()
                                if v - outcomes_before.get(k, 0)}
                    for run, row in json.loads(done.stdout.strip().splitlines()[-1]).items():
                        results[f"{client}/{run}"].append(row)
                        print(f"  round {round_index} {ROWS[f'{client}/{run}']:20s} "
                              f"{row['rollouts_per_s']:5.0f} rollouts/s "
                              f"CPU {row['cpu_us']:.0f} us/rollout "
                              f"p50 {row['p50_s']:5.2f} s p99 {row['p99_s']:5.2f} s "
                              f"peak RSS {row['peak_rss_mib']:.0f} MiB "
                              f"({row['rss_per_rollout_kib']:.1f} KiB/rollout) "
                              f"sockets peak {row['peak_sockets']} after {row['sockets_after']}",
                              flush=True)
                    print(f"    frontend answers during it: {outcomes}", flush=True)
    return results


def cluster_settings(args) -> dict:
    """The fleet's settings on the head of the nodes layout (``--cluster``), else none."""
    if not args.cluster:
        return {}
    cluster = json.loads(args.cluster)
    return {"placement": "ray", "ray_address": cluster["ray_address"],
            "bind_host": cluster["head"], "discovery": "etcd",
            "resources_per_worker": {WORKER_RESOURCE: 1}}


def run_on_nodes(args, argv: list[str]) -> int:
    """Make the layout, run this bench on its head (same arguments), stop every node."""
    per_node = -(-args.workers // (args.nodes - 1))
    with tempfile.TemporaryDirectory(prefix="bench-load-nodes-") as root:
        started = time.monotonic()
        layout = NodeLayout(root, count=args.nodes, worker_cpus=per_node,
                            worker_slots=per_node).start()
        try:
            print(f"{args.nodes} nodes up in {time.monotonic() - started:.1f} s: head "
                  f"{layout.head.address}, workers on "
                  f"{', '.join(n.address for n in layout.workers)} ({per_node} slots each)",
                  flush=True)
            cluster = json.dumps({"ray_address": layout.ray_address, "head": layout.head.address})
            return layout.run_on(1, [sys.executable, __file__, *argv, "--cluster", cluster],
                                 timeout_s=args.time_budget_s + 120, log_path=None)
        finally:
            stuck = layout.stop()
            if stuck:
                print(f"warning: processes of the layout would not stop: {stuck}", flush=True)


def report(mode: str, results: dict[str, list[dict]], rollouts: int) -> None:
    if not all(results.values()):
        return
    med = {key: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
           for key, rows in results.items()}
    print(f"\n{mode}: {rollouts} rollouts in flight at once, medians of "
          f"{len(results['driver/cold'])} run(s)")
    print(f"  {'client':22s} {'rollouts/s':>10s} {'CPU us':>7s} {'p50 s':>6s} {'p99 s':>6s} {'peak RSS MiB':>12s} "
          f"{'KiB/rollout':>11s} {'sockets peak':>12s} {'after':>5s}")
    for key, m in med.items():
        print(f"  {ROWS[key]:22s} {m['rollouts_per_s']:10.0f} {m['cpu_us']:7.0f} {m['p50_s']:6.2f} {m['p99_s']:6.2f} "
              f"{m['peak_rss_mib']:12.0f} {m['rss_per_rollout_kib']:11.1f} "
              f"{m['peak_sockets']:12.0f} {m['sockets_after']:5.0f}")
    u = med["upstream/cold"]
    for key in [k for k in ("driver/cold", "driver/warm") if k in med]:
        d = med[key]
        print(f"  {ROWS[key]} / session per request: rollouts/s "
              f"{d['rollouts_per_s'] / u['rollouts_per_s']:.2f}x, client CPU per rollout "
              f"{d['cpu_us'] / u['cpu_us']:.2f}x, p99 {d['p99_s'] / u['p99_s']:.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--token-delay-s", type=float, default=0.005)
    parser.add_argument("--modes", nargs="+", default=["round-robin", "kv"],
                        choices=["round-robin", "kv", "least-loaded", "random"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm", action="store_true",
                        help="the driver also runs a second batch on its warm pool")
    parser.add_argument("--time-budget-s", type=float, default=290.0)
    parser.add_argument("--nodes", type=int, default=0,
                        help="run against a fleet across this many nodes (namespaces on this "
                             "machine; root): the head plus nodes that hold the workers")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.nodes and not args.cluster:
        if not 2 <= args.nodes <= 9 or "kv" in args.modes:
            parser.error("--nodes in [2, 9], with --modes round-robin/random (the KV router's "
                         "event sockets bind 0.0.0.0)")
        return run_on_nodes(args, list(sys.argv[1:] if argv is None else argv))
    if not 1 <= args.rollouts <= 8192 or not 1 <= args.workers <= 16 or not 1 <= args.rounds <= 5:
        parser.error("--rollouts in [1, 8192], --workers in [1, 16], --rounds in [1, 5]")
    if "kv" in args.modes:
        from private_netns import reexec_in_private_netns
        from rollout_fleet.wiring.network import loopback_only

        if not loopback_only():
            print("KV router asked: re-running inside a private network namespace", flush=True)
            reexec_in_private_netns()
    deadline = time.monotonic() + args.time_budget_s
    print(f"{args.rollouts} rollouts of {MAX_NEW_TOKENS} tokens (prompts 8-24 tokens), "
          f"{args.workers} memory workers, {args.token_delay_s * 1e3:.0f} ms per token, "
          f"{os.cpu_count()} CPUs", flush=True)
    all_results = {}
    for mode in args.modes:
        all_results[mode] = measure_mode(mode, args, deadline)
    for mode, results in all_results.items():
        report(mode, results, args.rollouts)
    return 0


def own_rss_bytes() -> int:
    """This process's resident memory."""
    return psutil.Process().memory_info().rss


def own_open_sockets() -> int:
    """How many sockets this process holds open."""
    return len(psutil.Process().net_connections(kind="all"))


if __name__ == "__main__":
    raise SystemExit(main())

