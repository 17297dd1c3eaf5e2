"""The fleet's tokens/s at this checkout against another commit's, side by side in one run.

Two fleets resident at once, one per version, each in a child process of its own: a real
Dynamo frontend and in-memory-engine workers (local placement, loopback, inside this bench's
own network namespace), driven by the project's driver (``build_generation`` and
``generate_async``, greedy) in the same child. The other commit's four layer folders come from
``git archive`` into a temporary folder and shadow the installed ones on that child's
``PYTHONPATH`` (and its workers', which inherit it); each child prints where its code came
from. Rounds alternate between the two, the order rotating each round; the medians and their
ratio are printed, with the driver's CPU per rollout beside them and each fleet role's (its
workers, its frontend, its door's processes), read from its processes. The memory engine
makes the figure the fleet's own cost (frontend, worker host, driver), not an engine's.

The fleet started first ran 2-3% slower than the other on this machine, whatever its code
(this checkout against itself: driver CPU 1.034x when "this" started first, 0.984x when it
started second), so by default the comparison runs twice, each version's fleet started first
once, and the geometric mean of the two ratios is printed last.

    .venv/bin/python bench/bench_versions.py --against c867ee6 [--rounds 4] [--requests 512]
        [--concurrency 64] [--tokens 32] [--workers 2] [--first both|this|against]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

LAYERS = ("core", "ports", "adapters", "wiring")
SERVED_MODEL = "mem"
MAX_MODEL_LEN = 256


# -- the child: one resident fleet and its driver -----------------------------------------------
def serve(workers: int, tokens: int, run_dir: str) -> None:
    import rollout_fleet.core as core
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    fleet = Fleet.start(parse_config({
        "placement": "local", "num_workers": workers, "served_model_name": SERVED_MODEL,
        "engine": {"kind": "memory", "seed": 0, "context_length": MAX_MODEL_LEN},
        "max_model_len": MAX_MODEL_LEN, "max_new_tokens": tokens, "run_dir": run_dir,
        "timeouts": {"start_s": 180}}))
    try:
        print(json.dumps({"ready": True, "code": str(Path(core.__file__).parent.parent)}), flush=True)
        asyncio.run(answer_rounds(fleet, tokens))
    finally:
        fleet.shutdown()


async def answer_rounds(fleet, tokens: int) -> None:
    """One line in per round (``requests concurrency seed``), one JSON line out."""
    import torch
    from rollout_fleet.adapters.http import HttpSettings
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.wiring.driver import build_generation

    generation = None
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        requests, concurrency, seed = map(int, line.split())
        if generation is None:
            generation = build_generation(
                GenerationConfig(model=SERVED_MODEL, max_model_len=MAX_MODEL_LEN,
                                 max_new_tokens=tokens, max_in_flight=concurrency),
                frontend_url=fleet.frontend_url, control_secret=fleet.secret,
                workers=fleet.endpoints(), http=HttpSettings(max_in_flight=concurrency))
        batch = as_batch(torch, prompts(requests, seed))
        fleet_before = fleet_cpu_by_role()
        started, cpu = time.perf_counter(), time.process_time()
        generated = 0
        async for _index, sample in generation.generate_async(batch, greedy=True):
            generated += int(sample["generation_lengths"][0])
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        fleet_after = fleet_cpu_by_role()
        print(json.dumps({"seconds": seconds, "tokens": generated, "cpu_s": cpu_s,
                          "fleet_cpu_s": {role: fleet_after[role] - fleet_before[role]
                                          for role in fleet_after}}), flush=True)


FLEET_ROLES = {"rollout_fleet.wiring.worker": "workers", "dynamo.frontend": "frontend",
               "rollout_fleet.wiring.door_process": "door"}


def fleet_cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this child's fleet processes, summed by role (its workers, the
    frontend, the door's processes where there is a door)."""
    import psutil

    totals: dict[str, float] = dict.fromkeys(FLEET_ROLES.values(), 0.0)
    for process in psutil.Process().children(recursive=True):
        try:
            command = " ".join(process.cmdline())
            times = process.cpu_times()
        except psutil.Error:
            continue  # gone meanwhile
        role = next((r for module, r in FLEET_ROLES.items() if module in command), None)
        if role is not None:
            totals[role] += times.user + times.system
    return totals


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 47) for _ in range(rng.randint(8, 24))] for _ in range(count)]


def as_batch(torch, batch: list[list[int]]) -> dict:
    ids = torch.zeros((len(batch), max(map(len, batch))), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in batch])}


# -- the parent: the other commit's code, both children, interleaved rounds ----------------------
def shadow_tree(commit: str, work: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes ``rollout_fleet`` the commit's code."""
    source = work / "source"
    source.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *LAYERS],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = work / "shadow" / "rollout_fleet"
    package.mkdir(parents=True)
    for layer in LAYERS:
        (package / layer).symlink_to(source / layer)
    return package.parent


class Child:
    """One version's fleet and driver in a process group of its own."""

    def __init__(self, name: str, pythonpath: str | None, args, run_dir: Path) -> None:
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--workers", str(args.workers),
             "--tokens", str(args.tokens), "--run-dir", str(run_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            start_new_session=True)
        self.code = self.read()["code"]

    def read(self) -> dict:
        while line := self.process.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name}: its fleet stopped (exit {self.process.wait()})")

    def round(self, requests: int, concurrency: int, seed: int) -> dict:
        self.process.stdin.write(f"{requests} {concurrency} {seed}\n")
        self.process.stdin.flush()
        return self.read()

    def stop(self) -> None:
        from rollout_fleet.adapters.shared import stop_process_group

        if self.process.stdin:
            self.process.stdin.close()  # the child shuts its fleet down at end of input
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stop_process_group(self.process)


def measure(children: list[Child], args) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {child.name: [] for child in children}
    for child in children:  # warm-up: connections, first requests
        child.round(args.concurrency, args.concurrency, seed=999)
    for index in range(args.rounds):
        order = children if index % 2 == 0 else children[::-1]
        for child in order:
            results[child.name].append(child.round(args.requests, args.concurrency, seed=index))
    return results


def report(results: dict[str, list[dict]], args) -> dict[str, float]:
    """Prints each side's rounds and the ratios; returns the ratios (this / against)."""
    medians = {}
    for name, rounds in results.items():
        rates = [r["tokens"] / r["seconds"] for r in rounds]
        cpu_us = [1e6 * r["cpu_s"] / args.requests for r in rounds]
        medians[name] = (statistics.median(rates), statistics.median(cpu_us))
        print(f"{name:>8}: tokens/s " + " ".join(f"{rate:,.0f}" for rate in rates)
              + f"  (median {medians[name][0]:,.0f}); driver CPU per rollout median "
              f"{medians[name][1]:,.0f} us")
    (new_rate, new_cpu), (old_rate, old_cpu) = medians["this"], medians["against"]
    print(f"this / against: tokens/s {new_rate / old_rate:.3f}x; driver CPU per rollout "
          f"{new_cpu / old_cpu:.3f}x")
    roles = {name: {role: statistics.median(1e6 * r["fleet_cpu_s"].get(role, 0.0) / args.requests
                                            for r in rounds)
                    for role in FLEET_ROLES.values()} for name, rounds in results.items()}
    ratios = {"tokens/s": new_rate / old_rate, "driver CPU per rollout": new_cpu / old_cpu}
    for role in FLEET_ROLES.values():
        new, old = roles["this"][role], roles["against"][role]
        ratio = f"{new / old:.3f}x" if old else "-"
        print(f"  {role:>8} CPU per rollout median: this {new:,.0f} us, against {old:,.0f} us"
              f" ({ratio})")
        if old:
            ratios[f"{role} CPU per rollout"] = new / old
    return ratios


def compare(args, shadow: Path, work: Path, first: str) -> dict[str, float]:
    """Both fleets resident, ``first``'s started first, rounds interleaved; the ratios."""
    print(f"-- {first}'s fleet started first")
    code = {"this": None, "against": str(shadow)}
    started: dict[str, Child] = {}
    try:
        for name in sorted(code, key=lambda name: name != first):  # ``first`` first
            started[name] = Child(name, code[name], args, work / f"run-{name}-{first}")
        children = [started["this"], started["against"]]  # rounds start with "this"
        for child in children:
            print(f"{child.name:>8}: code from {child.code}")
        return report(measure(children, args), args)
    finally:
        for child in started.values():
            child.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="c867ee6", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--first", choices=("both", "this", "against"), default="both",
                        help="whose fleet starts first; both: a comparison each way")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.workers, args.tokens, args.run_dir)
        return 0
    from bench_standard_clients import unwind_on_sigterm
    from private_netns import reexec_in_private_netns

    reexec_in_private_netns()
    unwind_on_sigterm()  # the children live in process groups of their own
    work = Path(tempfile.mkdtemp(prefix="rollout-fleet-versions-"))
    try:
        shadow = shadow_tree(args.against, work)
        orders = ("this", "against") if args.first == "both" else (args.first,)
        runs = [compare(args, shadow, work, first) for first in orders]
        if len(runs) == 2:  # each start order's share cancels in the geometric mean
            print("both start orders (geometric mean): " + "; ".join(
                f"{name} {math.sqrt(runs[0][name] * runs[1][name]):.3f}x"
                for name in runs[0] if name in runs[1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
