"""A vLLM fleet whose start fails removes everything it made and says why: its engine core's
shared-memory segments in /dev/shm, the port claims of the driver, the placement and the
worker, every process; the error names what vLLM's engine core refused. The fleet runs in a
child process with a claims folder of its own (Ray's daemons and actors inherit it), so that
only this fleet's claims are counted; the segments are those this test's processes mapped."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from rollout_fleet.adapters.shared.port_claims import CLAIMS_DIR_ENV
from rollout_fleet.adapters.shared.shm import (WORKER_FILE_PREFIXES, SharedMemoryTracker,
                                               worker_processes)
from tests.support.processes import start_child, stop_child

pytestmark = [pytest.mark.ray, pytest.mark.vllm]
SCAN_EVERY_S = 0.25  # vLLM's queues live for seconds before the engine core gives up


class TreeWatch:
    """What a process tree maps in /dev/shm, and every process of it, scanned on a thread."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.segments = SharedMemoryTracker(root_pid, remove_unused=False,
                                            prefix=WORKER_FILE_PREFIXES)
        self.pids: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(SCAN_EVERY_S):
            self.segments.scan()
            self.pids.update(worker_processes(self.root_pid))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def still_there(seen: dict[str, int]) -> list[str]:
    """The recorded files that still exist as the same file (same inode)."""
    left = []
    for path, inode in seen.items():
        try:
            if os.stat(path).st_ino == inode:
                left.append(path)
        except FileNotFoundError:
            continue
    return left


def test_a_vllm_fleet_that_fails_to_start_leaves_nothing_and_names_the_cause(tmp_path):
    claims = tmp_path / "claims"
    log = tmp_path / "driver.log"
    env = {**os.environ, CLAIMS_DIR_ENV: str(claims)}
    child = start_child([sys.executable, "-m", "tests.support.failed_start", "ray"],
                        log_path=log, env=env, cwd=os.getcwd())
    watch = TreeWatch(child.pid)
    try:
        child.wait(timeout=600)
    finally:
        watch.stop()
        stop_child(child)
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    assert lines, log.read_text()[-3000:]
    report = json.loads(lines[-1])
    error = report["error"]
    assert error is not None and error.startswith("worker-0 exited while starting: "), error
    # The cause vLLM's engine core logged, not only "see root cause above".
    assert "its EngineCore logged ValueError: To serve at least one request" in error, error
    # The driver's, the placement's and the worker's claims: none left while the driver lives.
    assert report["claims"] == []
    segments = watch.segments.seen
    assert any("psm_" in path for path in segments), "the engine made no queue: nothing checked"
    assert still_there(segments) == []
    # Every process of its tree (Ray's daemons and actors, the worker, its engine core) gone.
    assert still_alive(watch.pids - {os.getpid()}, wait_s=30) == []


def still_alive(pids: set[int], wait_s: float) -> list[str]:
    """The command lines of ``pids`` still running (not zombies) after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [_cmdline(pid) for pid in sorted(pids) if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid}: (gone)"
