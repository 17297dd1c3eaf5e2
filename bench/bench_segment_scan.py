"""What the placement's /dev/shm watch costs the fleet's own process against N: one scan of every
worker's trackers reading /proc once (what the watch does every 2 s, and before a stop), beside
each tracker reading it for itself (what it did before), and a scan of one worker (before it is
killed). N idle processes, each the leader of its own group, stand in for the workers.

    .venv/bin/python bench/bench_segment_scan.py --workers 8,32,128
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable

from rollout_fleet.adapters.shared.shm import SegmentWatch


def cpu_ms(call: Callable[[], None], repeats: int) -> float:
    started = time.process_time()
    for _ in range(repeats):
        call()
    return (time.process_time() - started) / repeats * 1000


def measure(n: int, repeats: int) -> dict[str, float]:
    stand_ins = [subprocess.Popen(["sleep", "600"], process_group=0) for _ in range(n)]
    watch = SegmentWatch(interval_s=3600.0)  # scanned only when asked here
    try:
        trackers = [watch.track(f"worker-{i}", p.pid) for i, p in enumerate(stand_ins)]

        def each_reads_proc() -> None:
            for tracker in trackers:
                tracker.scan()

        return {"shared table": cpu_ms(watch.scan, repeats),
                "a table each": cpu_ms(each_reads_proc, repeats),
                "one worker": cpu_ms(lambda: watch.scan("worker-0"), repeats)}
    finally:
        watch.close()
        for process in stand_ins:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,32,128")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print("N     CPU ms per scan of every worker: shared table / a table each (ratio);  one worker")
    for n in (int(part) for part in args.workers.split(",")):
        figures = measure(n, args.repeats)
        print(f"{n:<5} {figures['shared table']:8.1f} / {figures['a table each']:8.1f} "
              f"({figures['shared table'] / figures['a table each']:.3f}x);  "
              f"{figures['one worker']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
