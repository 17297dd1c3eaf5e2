"""What the door's shared trajectory store costs per turn: one turn's read (``latest``) and
write (``record``) of a trajectory whose last turn holds P prompt tokens (+ 256 generated, with
their logprobs), in the SQLite store the door processes share and in a process's own memory,
with the store full to its capacity; then the same with W processes writing at once (each
turn's read + write; their median and p99).

    .venv/bin/python bench/bench_door_store.py [--capacity 4096] [--writers 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
from rollout_fleet.core.agent_turns import RecordedTurn, Trajectories, TrajectoryStore, TurnTokens

GENERATED = 256


def turn(prompt_tokens: int) -> RecordedTurn:
    tokens = TurnTokens(range(prompt_tokens), range(GENERATED), [-0.25] * GENERATED, 0,
                        [(0, GENERATED)])
    return RecordedTurn(4, ("system", "user", "assistant", "tool"), tokens, 7)


def per_turn_us(store: TrajectoryStore, recorded: RecordedTurn, capacity: int,
                turns: int) -> tuple[float, float]:
    for index in range(capacity):  # full: every write also evicts one
        store.record(f"fill-{index}", recorded, now=float(index))
    started = time.perf_counter()
    for index in range(turns):
        store.record(f"t-{index}", recorded, now=capacity + float(index))
    record_s = time.perf_counter() - started
    started = time.perf_counter()
    for index in range(turns):
        assert store.latest(f"t-{index}", now=capacity + float(turns)) is not None
    latest_s = time.perf_counter() - started
    return record_s / turns * 1e6, latest_s / turns * 1e6


def writer(path: str, prompt_tokens: int, turns: int, index: int,
           out: "multiprocessing.Queue[list[float]]") -> None:
    store, recorded, times = SqliteTrajectories(path), turn(prompt_tokens), []
    for number in range(turns):
        name, now = f"w{index}-{number % 64}", time.monotonic()
        started = time.perf_counter()
        store.latest(name, now)
        store.record(name, recorded, now)
        times.append((time.perf_counter() - started) * 1e6)
    out.put(times)


def concurrent_us(folder: Path, prompt_tokens: int, writers: int,
                  turns: int) -> tuple[float, float]:
    path = str(folder / f"concurrent-{prompt_tokens}.sqlite")
    SqliteTrajectories(path)
    out: multiprocessing.Queue[list[float]] = multiprocessing.Queue()
    processes = [multiprocessing.Process(target=writer, args=(path, prompt_tokens, turns, i, out))
                 for i in range(writers)]
    for process in processes:
        process.start()
    times = sorted(t for _ in processes for t in out.get())
    for process in processes:
        process.join()
    return statistics.median(times), times[int(len(times) * 0.99)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--turns", type=int, default=300)
    args = parser.parse_args()
    print(f"capacity {args.capacity}, {GENERATED} generated tokens per turn; microseconds")
    print(f"{'prompt':>7} {'sqlite record':>14} {'sqlite latest':>14} {'memory record':>14} "
          f"{'memory latest':>14} {f'{args.writers} writers p50':>16} {'p99':>8}")
    with tempfile.TemporaryDirectory() as folder:
        for prompt_tokens in (512, 4096, 32768):
            recorded = turn(prompt_tokens)
            sqlite = per_turn_us(SqliteTrajectories(Path(folder) / f"s{prompt_tokens}.sqlite",
                                                    args.capacity, 1e9),
                                 recorded, args.capacity, args.turns)
            memory = per_turn_us(Trajectories(args.capacity, 1e9), recorded, args.capacity,
                                 args.turns)
            p50, p99 = concurrent_us(Path(folder), prompt_tokens, args.writers, args.turns)
            print(f"{prompt_tokens:>7} {sqlite[0]:>14.0f} {sqlite[1]:>14.0f} {memory[0]:>14.1f} "
                  f"{memory[1]:>14.1f} {p50:>16.0f} {p99:>8.0f}")


if __name__ == "__main__":
    main()
