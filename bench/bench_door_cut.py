"""Where a generation cut finds the tokens of a call that another door process decodes: two
designs measured.

* **progress in the shared store**: every door process writes each captured call's tokens to
  the door's SQLite file as they stream (one write per chunk: the token and its logprob
  appended), so whichever process a cut reaches reads them. Measured: one write's cost and the
  writes per second that W processes reach together, each decoding its share of C calls.
* **the cut asks every sibling**: nothing is written while calls decode; the process a cut
  reaches sends the inventory to each sibling over its Unix socket (``cuts.py``), and each
  answers for the calls it holds. Measured: a cut's round trip to N siblings, an inventory of
  C calls, none held (what a holder stages is the same in both designs).

    .venv/bin/python bench/bench_door_cut.py [--writers 4] [--calls 256] [--cuts 50]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import hashlib
import json
import multiprocessing
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from aiohttp import web

from rollout_fleet.adapters.agent_door.capture import DoorCapture
from rollout_fleet.adapters.agent_door.cuts import GenerationCuts, sibling_socket
from rollout_fleet.adapters.agent_door.door_state import CaptureSettings
from rollout_fleet.core.generation_cut import CutInventory

PROGRESS = """CREATE TABLE IF NOT EXISTS progress (
    call TEXT PRIMARY KEY, tokens BLOB NOT NULL, logprobs BLOB NOT NULL)"""


def progress_writer(path: str, index: int, calls: int, tokens: int,
                    out: "multiprocessing.Queue[list[float]]") -> None:
    """One door process's share: ``calls`` calls decoding ``tokens`` tokens each, a token
    at a time, round robin (as a batch decodes), each token one committed write."""
    db = sqlite3.connect(path, isolation_level=None, timeout=10)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")
    names = [f"w{index}-c{call}" for call in range(calls)]
    db.executemany("INSERT OR REPLACE INTO progress VALUES (?, x'', x'')",
                   [(name,) for name in names])
    token, logprob = array.array("i", [7]).tobytes(), array.array("d", [-0.5]).tobytes()
    times = []
    for _step in range(tokens):
        for name in names:
            started = time.perf_counter()
            db.execute("UPDATE progress SET tokens = tokens || ?, logprobs = logprobs || ? "
                       "WHERE call = ?", (token, logprob, name))
            times.append((time.perf_counter() - started) * 1e6)
    out.put(times)


def shared_store(folder: Path, writers: int, calls: int, tokens: int) -> None:
    path = str(folder / "progress.sqlite")
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute(PROGRESS)
    db.close()
    out: multiprocessing.Queue[list[float]] = multiprocessing.Queue()
    share = max(1, calls // writers)
    processes = [multiprocessing.Process(target=progress_writer,
                                         args=(path, i, share, tokens, out))
                 for i in range(writers)]
    started = time.perf_counter()
    for process in processes:
        process.start()
    times = [t for _ in processes for t in out.get()]
    elapsed = time.perf_counter() - started
    for process in processes:
        process.join()
    times.sort()
    print(f"progress in the shared store: {writers} processes x {share} calls x {tokens} "
          f"tokens: {len(times) / elapsed:,.0f} writes/s together; one write median "
          f"{statistics.median(times):.0f} us, p99 {times[int(len(times) * 0.99)]:.0f} us")


def sibling(folder: str, index: int) -> None:
    """A door process's sibling side, holding no call (cuts enabled, nothing in flight)."""
    settings = CaptureSettings({}, "staging", cuts_enabled=True)

    class Holding(DoorCapture):
        async def settings(self) -> tuple[CaptureSettings | None, int]:
            return settings, 0

    async def serve() -> None:
        app = web.Application()
        GenerationCuts(Holding(None, None), None, None, None).add_sibling_routes(app)  # type: ignore[arg-type]  # no call held: no rendering
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(sibling_socket(Path(folder), 10_000 + index))).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


def inventory(calls: int) -> CutInventory:
    prefixes = [{"ticket_id": f"t{i:05d}", "rollout_id": f"r{i}", "attempt": 0,
                 "model_call_id": f"c{i}", "admitted_at": 1.0} for i in range(calls)]
    payload = {"checkpoint_id": "ckpt", "server_name": "policy", "active_prefixes": prefixes}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return CutInventory.from_wire({**payload, "inventory_digest": digest})


async def fan_out(folder: Path, calls: int, cuts: int) -> list[float]:
    settings = CaptureSettings({}, "staging", cuts_enabled=True)
    asking = GenerationCuts(DoorCapture(None, None), None, folder, folder / "own.sock")  # type: ignore[arg-type]  # no call held
    wanted, times = inventory(calls), []
    for _ in range(cuts):
        started = time.perf_counter()
        await asking.all_acks(wanted, settings, time.monotonic() + 30)
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)


def siblings(folder: Path, counts: list[int], calls: int, cuts: int) -> None:
    for count in counts:
        here = folder / f"siblings-{count}"
        here.mkdir()
        processes = [multiprocessing.Process(target=sibling, args=(str(here), i), daemon=True)
                     for i in range(count)]
        for process in processes:
            process.start()
        while len(list(here.glob("cut-*.sock"))) < count:
            time.sleep(0.05)
        times = asyncio.run(fan_out(here, calls, cuts))
        for process in processes:
            process.terminate()
            process.join()
        print(f"the cut asks {count} siblings (an inventory of {calls} calls): median "
              f"{statistics.median(times):.1f} ms, p99 {times[int(len(times) * 0.99)]:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cuts", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        shared_store(Path(folder), args.writers, args.calls, args.tokens)
        siblings(Path(folder), [1, 3, 7], args.calls, args.cuts)


if __name__ == "__main__":
    main()
