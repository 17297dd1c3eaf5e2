"""Scale: how each cost of a fleet grows with its number of workers N.

    .venv/bin/python bench/bench_scale.py --workers 8,32 --out out/scale
    .venv/bin/python bench/bench_scale.py --workers 128 --parts start,memory,throughput --out out/scale128

Loopback only: it re-runs itself inside a private network namespace (``unshare -n``), as the
other benches that start Dynamo's KV router do. For each N, up to three fleets of memory-engine
workers placed as local processes (a per-token delay stands in for a GPU's decode step, 16-token
rollouts), behind the real Dynamo frontend and driven by the real driver, one after the other:

  rr    round-robin router, file discovery, lost workers replaced: start, memory, throughput,
        fairness, refit, churn (in that order; churn changes the fleet); its workers are forked
        from the placement's worker template (worker_start = "fork", as kv's and etcd's)
  exec  as rr, each worker started as a new interpreter (worker_start = "exec"): start only
  kv    Dynamo's KV router: start, throughput, fairness
  etcd  round-robin router, etcd discovery: start, throughput

Measured against N:
  start       seconds from Fleet.start to every worker registered; seconds to stop it all
  memory      each worker process's RSS, USS (its own pages) and PSS, and the frontend's; again
              after a refit has loaded torch into every worker
  throughput  rollouts/s at each --in-flight level, from the driver in a child process (a fresh
              pool each run), with each serving process's cores and busiest thread over the run
              (bench/process_load.py): the busiest is what caps it
  fairness    rollouts each worker served in the largest run (its stats control): max/min and
              the coefficient of variation, round-robin and KV router
  refit       to every worker through the real gloo group, sent with --fanout (tree: relayed by
              the workers, core/fanout.py; broadcast: from the trainer to each): the fixed
              part (the first join, with torch's import in every worker; a later join;
              prepare_refit_info; an update carrying only the model's 3 KiB; a cache flush; one
              no-op control to all, and the driver's CPU per worker for it), each step
              relayed down the workers where N exceeds --relay-width, and then again through a
              second driver that calls every worker itself, side by side; and the data part
              of a 64 MiB and a 1 GiB refit (its update minus the 3 KiB one), against this
              machine's floor N x bytes / measured memory-copy bandwidth. The bytes are the memory
              engine's refit ballast (engine.refit_ballast_bytes): carried, received, dropped
  churn       10% of the workers killed while a batch is in flight: every rollout exactly once
              (none lost or duplicated), seconds until their replacements joined, the next refit
              (the replacements included), and whether each replacement then served
  discovery   start seconds and rollouts/s with file discovery vs etcd (skipped, saying so,
              where no etcd binary is on PATH)

Prints each figure and the ratios between Ns; writes results.json and one PNG per figure to
--out. Bounded: at most --time-budget-s (parts not reached are recorded as skipped), and a
fleet or refit that would not fit this machine's free memory is skipped, saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

MAX_NEW_TOKENS = 16
MAX_MODEL_LEN = 128
SIZES_MIB = (64, 1024)
REFIT_BUFFER_BYTES = 64 << 20  # each worker receives through 2 blocks of this: N x 128 MiB
FLEET_ENV = {"DYN_TCP_REQUEST_TIMEOUT": "120"}  # thousands in flight on 2 cores: room to answer
# What one idle worker needs (measured: 108 MiB resident) and one after a refit (torch: ~320).
IDLE_WORKER_MIB, REFIT_WORKER_MIB = 130, 340
ALL_PARTS = ("start", "memory", "throughput", "fairness", "refit", "churn", "discovery")
FLEETS = {"rr": {"router": "round-robin", "discovery": "file", "replace_lost_workers": True,
                 "worker_start": "fork"},
          "exec": {"router": "round-robin", "discovery": "file", "worker_start": "exec"},
          "kv": {"router": "kv", "discovery": "file", "worker_start": "fork"},
          "etcd": {"router": "round-robin", "discovery": "etcd", "worker_start": "fork"}}


# -- the driver in a child process ----------------------------------------------------------------
def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 47) for _ in range(rng.randint(8, 24))] for _ in range(count)]


def as_batch(prompts: list[list[int]]) -> dict:
    import torch

    ids = torch.zeros((len(prompts), max(len(p) for p in prompts)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])}


def client_main(spec_text: str) -> int:
    """One batch from a fresh driver; prints rollouts/s and how many came back how often."""
    spec = json.loads(spec_text)
    from rollout_fleet.adapters.http import HttpSettings
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation

    data = as_batch(make_prompts(spec["rollouts"], spec["seed"]))
    config = GenerationConfig(model="mem", max_model_len=MAX_MODEL_LEN,
                              max_new_tokens=MAX_NEW_TOKENS, max_in_flight=spec["in_flight"])
    generation = build_generation(
        config, frontend_url=spec["url"], control_secret=spec["secret"],
        workers=[WorkerEndpoint(name, url) for name, url in spec["workers"]],
        http=HttpSettings(max_in_flight=spec["in_flight"]))
    gc.collect()
    gc.freeze()  # the libraries' heap out of the collector's way during the batch

    async def batch() -> tuple[collections.Counter, float]:
        seen: collections.Counter = collections.Counter()
        started = time.perf_counter()
        async for index, _sample in generation.generate_async(data, greedy=True):
            seen[index] += 1
        wall = time.perf_counter() - started
        await generation._transport.aclose()  # this loop's pool
        return seen, wall

    cpu_started = time.process_time()
    seen, wall = asyncio.run(batch())
    cpu_s = time.process_time() - cpu_started
    generation.shutdown()
    n = spec["rollouts"]
    print(json.dumps({"rollouts_per_s": n / wall, "wall_s": wall, "driver_cores": cpu_s / wall,
                      "lost": sum(1 for i in range(n) if seen[i] == 0),
                      "duplicated": sum(c - 1 for c in seen.values() if c > 1)}))
    return 0


# -- what is measured on a running fleet ----------------------------------------------------------
def process_memory(pid: int) -> dict[str, float]:
    import psutil

    info = psutil.Process(pid).memory_full_info()
    return {"rss_mib": info.rss / 2**20, "uss_mib": info.uss / 2**20, "pss_mib": info.pss / 2**20}


def fleet_memory(fleet) -> dict:
    """Each live worker's process (with any children) and the frontend's, in MiB."""
    workers = []
    for worker in fleet.workers:
        if worker.name in fleet.dead_workers():
            continue
        workers.append(_with_children(worker.pid))
    summary = {key: {"median": statistics.median(w[key] for w in workers),
                     "max": max(w[key] for w in workers), "sum": sum(w[key] for w in workers)}
               for key in ("rss_mib", "uss_mib", "pss_mib")}
    return {"workers": summary, "frontend": _with_children(fleet.frontend.process.pid),
            "count": len(workers)}


def _with_children(pid: int) -> dict[str, float]:
    import psutil

    totals = collections.Counter()
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            totals.update(process_memory(process.pid))
        except psutil.Error:
            continue
    return dict(totals)


def served_counts(fleet) -> dict[str, int]:
    from rollout_fleet.wiring.fleet import call_control

    return {name: int(call_control(url, "stats", fleet.secret)["served"])
            for name, url in fleet.control_urls.items() if name not in fleet.dead_workers()}


def spread(counts: list[int]) -> dict:
    mean = statistics.fmean(counts)
    return {"min": min(counts), "max": max(counts), "mean": mean,
            "max_over_min": max(counts) / max(min(counts), 1),
            "cv": statistics.pstdev(counts) / mean if mean else 0.0}


def run_client(fleet, in_flight: int, rollouts: int, seed: int, deadline: float) -> dict:
    """A batch from the driver in a child process, with every serving process's load and each
    worker's share."""
    from process_load import load_between, snapshot

    spec = {"url": fleet.frontend_url, "secret": fleet.secret, "rollouts": rollouts,
            "in_flight": in_flight, "seed": seed,
            "workers": [(e.worker_id, e.system_url) for e in fleet.endpoints(live_only=True)]}
    leaders = fleet.process_groups() + [os.getpid()]
    before_served, before_load = served_counts(fleet), snapshot(leaders)
    done = subprocess.run([sys.executable, __file__, "--client", json.dumps(spec)],
                          capture_output=True, text=True,
                          timeout=max(30.0, deadline - time.monotonic()))
    after_load = snapshot(leaders)
    load = load_between(before_load, after_load)
    if done.returncode != 0:
        raise RuntimeError(f"the driver's child failed:\n{done.stderr[-3000:]}")
    after = served_counts(fleet)
    shares = [after[name] - before_served.get(name, 0) for name in after]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    cores = cores_by_role(load, after_load["t"] - before_load["t"])
    # The child had ended by the last snapshot: its own figure.
    cores["driver"] = round(cores.get("driver", 0.0) + row["driver_cores"], 2)
    cores["total"] = round(cores["total"] + row["driver_cores"], 2)
    return {**row, "in_flight": in_flight, "rollouts": rollouts, "load": load[:4],
            "cores": cores, "per_worker": shares, "spread": spread(shares)}


def cores_by_role(load: list[dict], wall_s: float) -> dict[str, float]:
    """Cores over a round (CPU seconds per wall second), summed by role: every worker
    together, the frontend, the driver (this bench and its child), and all of them. From
    each process's CPU seconds, not its rounded cores: 128 workers' roundings add up."""
    roles: collections.Counter = collections.Counter()
    for row in load:
        title = row["process"]
        role = ("workers" if "rollout_fleet.wiring.worker" in title else
                "frontend" if "dynamo.frontend" in title else
                "driver" if "bench_scale" in title else "other")
        roles[role] += row["cpu_s"] / wall_s
    roles["total"] = sum(row["cpu_s"] for row in load) / wall_s
    return {role: round(cores, 2) for role, cores in roles.items()}


def idle_cores(fleet, seconds: float = 5.0) -> dict[str, float]:
    """What the fleet burns doing nothing (its processes' cores over ``seconds``)."""
    from process_load import load_between, snapshot

    leaders = fleet.process_groups()
    before = snapshot(leaders)
    time.sleep(seconds)
    after = snapshot(leaders)
    return cores_by_role(load_between(before, after), after["t"] - before["t"])


# -- refit -------------------------------------------------------------------------------------------
class Trainer:
    """The trainer's end of the refit group (rank 0), over the real driver's refit calls."""

    def __init__(self, generation, timeout_s: float) -> None:
        self.generation = generation
        self.timeout_s = timeout_s
        self.session = None

    def join(self) -> float:
        from rollout_fleet.adapters.collective import TrainerRefitSession
        from rollout_fleet.adapters.shared import free_port, release_ports

        self.close()
        started = time.perf_counter()
        world = 1 + self.generation.get_inference_world_size()
        port = free_port()
        joining = self.generation.init_collective("127.0.0.1", port, world, train_world_size=1)
        self.session = TrainerRefitSession("127.0.0.1", port, 0, world, timeout_s=self.timeout_s,
                                           spec=self.generation.get_collective_sender_spec())
        for future in joining:
            future.result(timeout=self.timeout_s)
        release_ports([port])  # bound by the group now
        return time.perf_counter() - started

    def prepare(self, state: dict) -> tuple[object, float]:
        started = time.perf_counter()
        info = self.generation.prepare_refit_info(
            {name: (tuple(t.shape), _dtype(t)) for name, t in state.items()})
        return info, time.perf_counter() - started

    def update(self, state: dict, info) -> tuple[list[int], float]:
        started = time.perf_counter()
        updates = self.generation.update_weights_from_collective()
        self.session.send_state_dict(state, info)
        versions = [f.result(timeout=self.timeout_s)["weight_version"] for f in updates]
        return versions, time.perf_counter() - started

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def model_state(seed: int) -> dict:
    import torch

    from rollout_fleet.adapters.memory.engine import TinyBigramModel

    return {name: torch.tensor(matrix, dtype=torch.float32)
            for name, matrix in TinyBigramModel.from_seed(seed).state_dict().items()}


def ballast_state(nbytes: int) -> dict:
    import torch

    from rollout_fleet.adapters.memory.model import ballast_metas

    return {name: torch.full(meta.shape, index % 251, dtype=torch.uint8)
            for index, (name, meta) in enumerate(ballast_metas(nbytes).items())}


def copy_bandwidth() -> float:
    """This machine's memory-copy bandwidth (bytes/s): the best of 5 copies of 256 MiB."""
    import torch

    source = torch.ones(256 << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # pages faulted in before timing
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return source.numel() / best


def measure_refit(fleet, generation, args, bandwidth: float) -> dict:
    """Fixed and data parts of refits to every worker; memory after torch came in."""
    n = len(fleet.endpoints(live_only=True))
    trainer = Trainer(generation, timeout_s=args.refit_timeout_s)
    model = model_state(seed=1)
    result: dict = {"workers": n, "copy_bandwidth_gb_s": bandwidth / 1e9}
    try:
        result["join_first_s"] = trainer.join()
        result["join_again_s"] = trainer.join()
        result.update(fixed_part(trainer, generation, model, args.refit_reps, n))
        info, _ = trainer.prepare(model)
        result["sizes"] = {}
        for mib in args.refit_mib:
            state = {**model, **ballast_state(mib << 20)}
            info, _ = trainer.prepare(state)
            runs = [trainer.update(state, info) for _ in range(args.refit_reps)]
            versions = runs[-1][0]
            del state
            update_s = min(seconds for _, seconds in runs)
            floor_s = n * (mib << 20) / bandwidth
            data_s = max(0.0, update_s - result["update_model_only_s"])
            result["sizes"][str(mib)] = {
                "update_s": update_s, "data_s": data_s, "floor_s": floor_s,
                "data_over_floor": data_s / floor_s, "gb_s_to_all": n * (mib << 20) / update_s / 1e9,
                "versions_equal": len(set(versions)) == 1}
            print(f"    refit {mib} MiB to {n}: {update_s:.2f} s (data {data_s:.2f} s, floor "
                  f"{floor_s:.2f} s, {data_s / floor_s:.1f}x)", flush=True)
        result["memory_after"] = fleet_memory(fleet)
    finally:
        trainer.close()
    if relayed(args, n):  # the same steps with the driver calling every worker, side by side
        result["direct"] = direct_fixed_part(fleet, args, model, n)
        print(f"    fixed part, relayed {result['fixed_s']:.3f} s, the driver calling every worker "
              f"{result['direct']['fixed_s']:.3f} s", flush=True)
    return result


def relayed(args, n: int) -> bool:
    return 0 < args.relay_width < n


def fixed_part(trainer: Trainer, generation, model: dict, reps: int, n: int) -> dict:
    """The refit's steps whose cost is not the bytes: prepare, an update carrying only the
    model's 3 KiB, a cache flush (each the best of ``reps``); a weight-version call's seconds
    and the driver's CPU per worker in it."""
    info = None
    prepares = []
    for _ in range(reps):
        info, seconds = trainer.prepare(model)
        prepares.append(seconds)
    part = {"prepare_s": min(prepares),
            "update_model_only_s": min(trainer.update(model, info)[1] for _ in range(reps)),
            "flush_s": min(_timed(generation.invalidate_kv_cache) for _ in range(reps))}
    cpu_started = time.process_time()
    part["control_s"] = _timed(generation.get_weight_versions)
    part["control_cpu_s_per_worker"] = (time.process_time() - cpu_started) / n
    part["fixed_s"] = part["prepare_s"] + part["update_model_only_s"] + part["flush_s"]
    return part


def direct_fixed_part(fleet, args, model: dict, n: int) -> dict:
    """``fixed_part`` through a second driver of the same fleet whose relay is off: the
    driver's own call to every worker, in the same run (the group formed again)."""
    generation = fleet.generation(max_new_tokens=MAX_NEW_TOKENS, max_model_len=MAX_MODEL_LEN,
                                  max_in_flight=64, control_relay_width=0)
    trainer = Trainer(generation, timeout_s=args.refit_timeout_s)
    try:
        trainer.join()
        return fixed_part(trainer, generation, model, args.refit_reps, n)
    finally:
        trainer.close()
        generation.shutdown()


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


# -- churn -------------------------------------------------------------------------------------------
def measure_churn(fleet, generation, args) -> dict:
    """Kill 10% of the workers while a batch is in flight; the batch, the replacements, the
    next refit, the replacements serving."""
    live = [e.worker_id for e in fleet.endpoints(live_only=True)]
    kill = max(1, round(0.1 * len(live)))
    victims = live[::len(live) // kill][:kill]  # spread over the fleet
    count = args.churn_rollouts or 40 * len(live)
    data = as_batch(make_prompts(count, seed=77))
    seen: collections.Counter = collections.Counter()
    killed_at: list[float] = []

    async def batch() -> None:
        async def kill_when_under_way() -> None:
            while sum(seen.values()) < count // 5:
                await asyncio.sleep(0.01)
            killed_at.append(time.monotonic())
            for name in victims:
                await asyncio.to_thread(fleet.placement.kill, name)

        killer = asyncio.ensure_future(kill_when_under_way())
        async for index, _sample in generation.generate_async(data, greedy=True):
            seen[index] += 1
        await killer

    started = time.monotonic()
    asyncio.run(batch())
    result = {"workers": len(live), "killed": victims, "rollouts": count,
              "batch_s": time.monotonic() - started,
              "lost": sum(1 for i in range(count) if seen[i] == 0),
              "duplicated": sum(c - 1 for c in seen.values() if c > 1)}
    replacements = wait_for_replacements(fleet, live, victims, args.start_timeout_s)
    result["replaced_s"] = time.monotonic() - killed_at[0]
    result["replacements"] = replacements
    trainer = Trainer(generation, timeout_s=args.refit_timeout_s)
    try:
        join_s = trainer.join()
        model = model_state(seed=2)
        info, prepare_s = trainer.prepare(model)
        versions, update_s = trainer.update(model, info)
    finally:
        trainer.close()
    result.update(refit_s=join_s + prepare_s + update_s, refit_join_s=join_s,
                  versions_equal=len(set(versions)) == 1, weight_version=max(versions))
    result["serving_s"], result["replacements_served"] = wait_until_served(
        fleet, generation, replacements, timeout_s=60.0)
    return result


def wait_for_replacements(fleet, before: list[str], victims: list[str], timeout_s: float
                          ) -> list[str]:
    """The workers registered since ``before`` once there is one for each victim."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = {e.worker_id for e in fleet.endpoints(live_only=True)}
        fresh = sorted(live - set(before))
        if len(fresh) >= len(victims) and not live & set(victims):
            return fresh
        if time.monotonic() > deadline:
            raise RuntimeError(f"replacements for {victims} not all registered in {timeout_s} s")
        time.sleep(0.2)


def wait_until_served(fleet, generation, names: list[str], timeout_s: float
                      ) -> tuple[float, dict[str, int]]:
    """Small batches until each replacement served one (the frontend retries a worker it kept
    away a few seconds later); seconds taken and what each served."""
    started = time.monotonic()
    before = served_counts(fleet)
    while True:
        served = {name: served_counts(fleet)[name] - before.get(name, 0) for name in names}
        if all(served.values()) or time.monotonic() - started > timeout_s:
            return time.monotonic() - started, served
        data = as_batch(make_prompts(4 * len(fleet.endpoints(live_only=True)), seed=78))
        asyncio.run(_drain(generation, data))


async def _drain(generation, data) -> None:
    async for _pair in generation.generate_async(data, greedy=True):
        pass


# -- one fleet -------------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def fleet_config(kind: str, n: int, run_dir: str, args):
    from rollout_fleet.wiring.config import parse_config

    return parse_config({
        "placement": "local", "num_workers": n, "served_model_name": "mem",
        "engine": {"kind": "memory", "context_length": MAX_MODEL_LEN,
                   "token_delay_s": args.token_delay_s,
                   "refit_ballast_bytes": max(args.refit_mib, default=0) << 20},
        "max_model_len": MAX_MODEL_LEN, "env": FLEET_ENV, "run_dir": run_dir,
        "refit": {"buffer_bytes": REFIT_BUFFER_BYTES, "num_buffers": 2, "fanout": args.fanout,
                  "control_relay_width": args.relay_width},
        "timeouts": {"start_s": args.start_timeout_s, "refit_s": args.refit_timeout_s},
        **FLEETS[kind]})


FREE_MIB_GIVEN: list[float] = []  # --free-gib, once parsed


def free_mib() -> float:
    """What this machine can still give: --free-gib less what the fleets took since, where
    given (a machine that grows its memory as it is used reports less at first), else what it
    reports available."""
    import psutil

    memory = psutil.virtual_memory()
    if FREE_MIB_GIVEN:
        return FREE_MIB_GIVEN[0] - memory.used / 2**20
    return memory.available / 2**20


def run_fleet(kind: str, n: int, args, budget: Budget, bandwidth: float) -> dict:
    from rollout_fleet.wiring.fleet import Fleet

    parts = set(args.parts)
    need = n * IDLE_WORKER_MIB + 1024
    if free_mib() < need:
        return {"skipped": f"needs ~{need / 1024:.1f} GiB free, {free_mib() / 1024:.1f} available"}
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-scale-{kind}-{n}-") as run_dir:
        started = time.monotonic()
        fleet = Fleet.start(fleet_config(kind, n, run_dir, args))
        result["start_s"] = time.monotonic() - started
        print(f"  [{kind}] {n} workers up in {result['start_s']:.1f} s", flush=True)
        generation = None
        if kind == "exec":
            parts = set()  # its start (and stop) only
        try:
            if "memory" in parts:
                result["memory"] = fleet_memory(fleet)
                m = result["memory"]["workers"]
                result["idle_cores"] = idle_cores(fleet)
                print(f"    per worker: RSS {m['rss_mib']['median']:.0f} MiB, USS "
                      f"{m['uss_mib']['median']:.0f}, PSS {m['pss_mib']['median']:.0f} (median); "
                      f"idle, the fleet burns {result['idle_cores']}", flush=True)
            if parts & {"throughput", "fairness", "discovery"}:
                result["throughput"] = measure_throughput(fleet, args, budget)
            if kind == "rr" and parts & {"refit", "churn"}:
                generation = fleet.generation(max_new_tokens=MAX_NEW_TOKENS,
                                              max_model_len=MAX_MODEL_LEN, max_in_flight=512)
            if kind == "rr" and "refit" in parts:
                result["refit"] = guarded("refit", budget, part_s(n, 8), lambda: refit_if_it_fits(
                    fleet, generation, args, bandwidth))
            if kind == "rr" and "churn" in parts:
                # Its refit brings torch into every worker, as the refit part's does.
                refit_before = "sizes" in result.get("refit", {})  # torch in every worker already
                fresh = max(1, round(0.1 * n)) if refit_before else None
                result["churn"] = guarded("churn", budget, part_s(n, 6), lambda: refit_fits(
                    fleet, args, fresh) or measure_churn(fleet, generation, args))
                print(f"    churn: {_churn_line(result['churn'])}", flush=True)
        finally:
            if generation is not None:
                generation.shutdown()
            stopping = time.monotonic()
            fleet.shutdown()
            result["stop_s"] = time.monotonic() - stopping
    return result


def part_s(n: int, core_s_per_worker: float) -> float:
    """About what a refit or churn part of N workers takes here: its workers' CPU (torch's
    import in each) shared by this machine's cores, and half a minute."""
    return 30 + n * core_s_per_worker / (os.cpu_count() or 1)


def guarded(part: str, budget: Budget, needs_s: float, measure) -> dict:
    if budget.left() < needs_s:
        return {"skipped": f"the time budget left {budget.left():.0f} s, {part} needs ~{needs_s:.0f} s"}
    return measure()


def refit_if_it_fits(fleet, generation, args, bandwidth: float) -> dict:
    return refit_fits(fleet, args) or measure_refit(fleet, generation, args, bandwidth)


def refit_fits(fleet, args, fresh: int | None = None) -> dict | None:
    """None when a refit to every worker fits this machine's free memory, else why not: it
    brings torch and the receive blocks into every worker not refit before (``fresh``, default
    all: about 300 MiB of each's own); the trainer holds the refit twice."""
    n = len(fleet.workers) if fresh is None else fresh
    need = n * (REFIT_WORKER_MIB - IDLE_WORKER_MIB + 2 * (REFIT_BUFFER_BYTES >> 20)) \
        + 2 * max(args.refit_mib, default=0)
    if free_mib() >= need:
        return None
    return {"skipped": f"a refit to {n} workers new to refits needs ~{need / 1024:.1f} GiB more "
                       f"free (torch and receive blocks in each), {free_mib() / 1024:.1f} "
                       "available"}


def measure_throughput(fleet, args, budget: Budget) -> list[dict]:
    rows = []
    for seed, in_flight in enumerate(args.in_flight):
        if budget.left() < 60:
            rows.append({"in_flight": in_flight, "skipped": "time budget"})
            continue
        row = run_client(fleet, in_flight, args.rollouts, seed, budget.deadline)
        rows.append(row)
        cap = row["load"][0] if row["load"] else {}
        print(f"    {in_flight:5d} in flight: {row['rollouts_per_s']:7.0f} rollouts/s, lost "
              f"{row['lost']}, duplicated {row['duplicated']}, per worker {row['spread']['min']}-"
              f"{row['spread']['max']} (cv {row['spread']['cv']:.2f}); cores {row['cores']}; "
              f"busiest: {cap.get('process', '?')} {cap.get('cores', 0):.2f} cores, its busiest "
              f"thread {cap.get('busiest_thread_share', 0):.2f}", flush=True)
    return rows


def _churn_line(churn: dict) -> str:
    if "skipped" in churn:
        return churn["skipped"]
    return (f"killed {len(churn['killed'])} of {churn['workers']} under {churn['rollouts']} "
            f"rollouts: lost {churn['lost']}, duplicated {churn['duplicated']}; replacements in "
            f"{churn['replaced_s']:.1f} s, refit {churn['refit_s']:.1f} s (versions equal: "
            f"{churn['versions_equal']}), each replacement served: "
            f"{all(churn['replacements_served'].values())} ({churn['serving_s']:.1f} s)")


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,32,128", help="the Ns, comma-separated")
    parser.add_argument("--out", help="folder for results.json and the plots (required)")
    parser.add_argument("--parts", default=",".join(ALL_PARTS))
    parser.add_argument("--rollouts", type=int, default=4000, help="per throughput run")
    parser.add_argument("--in-flight", default="256,1024")
    parser.add_argument("--token-delay-s", type=float, default=0.005)
    parser.add_argument("--refit-mib", default=",".join(map(str, SIZES_MIB)))
    parser.add_argument("--refit-reps", type=int, default=2)
    parser.add_argument("--fanout", choices=("tree", "broadcast"), default="tree",
                        help="how a refit reaches the workers ([refit] fanout)")
    parser.add_argument("--relay-width", type=int, default=8,
                        help="[refit] control_relay_width: the driver's calls per refit step, "
                             "relayed on by the workers (0: the driver calls every worker; "
                             "then the fixed part is measured that way alone)")
    parser.add_argument("--churn-rollouts", type=int, default=0, help="0: 40 per worker")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--refit-timeout-s", type=float, default=300.0)
    parser.add_argument("--time-budget-s", type=float, default=1800.0)
    parser.add_argument("--free-gib", type=float, default=0.0,
                        help="the memory the fleets may take (0: what the machine reports "
                             "available): the machines that grow their memory as it is used")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return args
    if not args.out:
        parser.error("--out is required")
    args.workers = [int(x) for x in args.workers.split(",")]
    args.in_flight = [int(x) for x in args.in_flight.split(",")]
    args.refit_mib = [int(x) for x in args.refit_mib.split(",") if x]
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = set(args.parts) - set(ALL_PARTS)
    if unknown or not all(1 <= n <= 128 for n in args.workers) or not 1 <= args.rollouts <= 20000 \
            or not all(1 <= f <= 4096 for f in args.in_flight) or max(args.refit_mib, default=0) > 4096:
        parser.error(f"--workers in [1, 128], --rollouts in [1, 20000], --in-flight in [1, 4096], "
                     f"--refit-mib at most 4096, --parts of {', '.join(ALL_PARTS)}")
    return args


def fleets_for(parts: list[str]) -> list[str]:
    """rr always; exec for the start's comparison; kv for the router's fairness; etcd for the
    discovery comparison."""
    return (["rr"] + (["exec"] if "start" in parts else []) + (["kv"] if "fairness" in parts else [])
            + (["etcd"] if "discovery" in parts else []))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.client:
        return client_main(args.client)
    from private_netns import reexec_in_private_netns

    reexec_in_private_netns()
    import process_load

    process_load.SHOWN_CPU_S = 0.0  # sums over a fleet: its many small processes count too
    from scale_figures import report, write_plots

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.free_gib:
        import psutil

        FREE_MIB_GIVEN.append(args.free_gib * 1024 + psutil.virtual_memory().used / 2**20)
    budget = Budget(args.time_budget_s)
    bandwidth = copy_bandwidth() if "refit" in args.parts else 0.0
    print(f"N = {args.workers}; {os.cpu_count()} CPUs, {free_mib() / 1024:.1f} GiB free; memory "
          f"copy {bandwidth / 1e9:.1f} GB/s; {MAX_NEW_TOKENS}-token rollouts, "
          f"{args.token_delay_s * 1e3:g} ms a token", flush=True)
    results = {"args": {k: v for k, v in vars(args).items() if k != "client"},
               "cpus": os.cpu_count(), "copy_bandwidth_gb_s": bandwidth / 1e9, "by_n": {}}
    for n in args.workers:
        print(f"\nN = {n}", flush=True)
        by_kind = results["by_n"][str(n)] = {}
        for kind in fleets_for(args.parts):
            if budget.left() < 90:
                by_kind[kind] = {"skipped": "time budget"}
                continue
            if kind == "etcd" and shutil.which("etcd") is None:
                by_kind[kind] = {"skipped": "no etcd binary on PATH"}
                continue
            by_kind[kind] = run_fleet(kind, n, args, budget, bandwidth)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(report(results))
    for path in write_plots(results, out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
