"""How soon a refit's control call starts running under Ray: a Ray task per call (a process
started, the driver's modules imported) against one long-lived actor (adapters/nemo_rl/
ray_calls.py), side by side in each round, on an idle host and with CPU burners beside it.

    .venv/bin/python bench/bench_refit_calls.py --rounds 5 --burners 0,4 --other-actors 2

Each round waits ``--gap-s`` first, so Ray may retire idle task workers as it does between
training steps. Prints each round's seconds from submit to the call running, and the median
ratio task / actor.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import time


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def call_in_a_task() -> float:
    # What unpickling a ControlCall's caller imported in a fresh task worker.
    import rollout_fleet.adapters.nemo_rl.refit  # noqa: F401

    return time.time()


class Caller:
    def started(self) -> float:
        return time.time()


def measure(ray, rounds: int, gap_s: float, others: int) -> list[tuple[float, float]]:
    task = ray.remote(num_cpus=0, max_retries=0)(call_in_a_task)
    actor = ray.remote(num_cpus=0)(Caller).remote()
    # Other actors hold Ray worker processes, as a fleet's worker supervisors do.
    held = [ray.remote(num_cpus=0)(Caller).remote() for _ in range(others)]
    ray.get([a.started.remote() for a in (actor, *held)])  # all running, as after init_collective
    figures = []
    for _ in range(rounds):
        time.sleep(gap_s)
        sent = time.time()
        task_start = ray.get(task.remote(), timeout=300)
        task_s = task_start - sent
        sent = time.time()
        actor_s = ray.get(actor.started.remote(), timeout=300) - sent
        figures.append((task_s, actor_s))
    for each in (actor, *held):
        ray.kill(each)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burners", default="0,4", help="CPU-burning processes beside Ray, per run")
    parser.add_argument("--gap-s", type=float, default=3.0)
    parser.add_argument("--other-actors", type=int, default=2,
                        help="actors holding Ray workers meanwhile (a fleet's supervisors)")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _node_ip_address="127.0.0.1")
    try:
        for burners in (int(b) for b in args.burners.split(",")):
            seconds = args.rounds * (args.gap_s + 30) + 30
            procs = [multiprocessing.Process(target=_burn, args=(seconds,), daemon=True)
                     for _ in range(burners)]
            for proc in procs:
                proc.start()
            try:
                figures = measure(ray, args.rounds, args.gap_s, args.other_actors)
            finally:
                for proc in procs:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join()
            print(f"{burners} burner(s), {os.cpu_count()} cores: submit -> running, seconds")
            for task_s, actor_s in figures:
                print(f"  task per call {task_s:7.3f}   long-lived actor {actor_s:7.3f}")
            ratio = statistics.median(t / max(a, 1e-6) for t, a in figures)
            print(f"  median ratio task / actor: {ratio:.0f}x")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
