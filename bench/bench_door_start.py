"""What the fleet's door adds to a fleet's start and stop: a fleet of memory-engine workers
(local processes, file discovery, the real Dynamo frontend) started and stopped ``--runs``
times with its door (``[door] processes``, default ``min(4, cores)``) and as often without
(``processes = 0``), alternating, each start timed by ``Fleet.start`` and each stop by
``shutdown``; then one door request that needs the tokenizer (its first load, in a door
process). Prints each run and the medians.

    .venv/bin/python bench/bench_door_start.py [--runs 5] [--workers 2] [--processes N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def one_start(work: Path, workers: int, processes: int | None) -> tuple[float, float, float]:
    """(start s, stop s, first tokenizer request s; nan without a door)."""
    import httpx

    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    door = {} if processes is None else {"processes": processes}
    config = parse_config({
        "engine": {"kind": "memory", "seed": 0, "context_length": 128}, "model": "tiny",
        "served_model_name": "mem", "placement": "local", "num_workers": workers,
        "max_model_len": 128, "run_dir": str(Path(tempfile.mkdtemp(dir=work)) / "run"),
        "door": door})
    started = time.perf_counter()
    fleet = Fleet.start(config)
    start_s = time.perf_counter() - started
    first = float("nan")
    try:
        if fleet.door is not None:
            asked = time.perf_counter()
            answer = httpx.post(f"{fleet.door_url}/tokenize", json={"prompt": "ab"}, timeout=60)
            answer.raise_for_status()
            first = time.perf_counter() - asked
    finally:
        stopping = time.perf_counter()
        fleet.shutdown()
    return start_s, time.perf_counter() - stopping, first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--processes", type=int, default=None,
                        help="door processes (default: the [door] default, min(4, cores))")
    args = parser.parse_args()
    from private_netns import reexec_in_private_netns

    reexec_in_private_netns()
    work = Path(tempfile.mkdtemp(prefix="bench-door-start-"))
    times: dict[str, list[tuple[float, float, float]]] = {"door": [], "no door": []}
    one_start(work, args.workers, 0)  # warm the file cache (imports, the frontend's binary)
    ways = [("door", args.processes), ("no door", 0)]
    for run in range(args.runs):
        for way, processes in ways if run % 2 == 0 else ways[::-1]:
            times[way].append(one_start(work, args.workers, processes))
            start_s, stop_s, first = times[way][-1]
            print(f"run {run} {way:>7}: start {start_s:.2f} s, stop {stop_s:.2f} s"
                  + (f", first tokenizer request {first:.2f} s" if way == "door" else ""),
                  flush=True)
    for way, rows in times.items():
        print(f"{way:>7}: median start {statistics.median(r[0] for r in rows):.2f} s, "
              f"stop {statistics.median(r[1] for r in rows):.2f} s", flush=True)
    extra = statistics.median(r[0] for r in times["door"]) - \
        statistics.median(r[0] for r in times["no door"])
    print(f"the door adds {extra:+.2f} s to a start (medians of {args.runs}); its first "
          f"tokenizer request {statistics.median(r[2] for r in times['door']):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
