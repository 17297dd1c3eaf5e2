"""Child processes for tests: each in its own process group, stopped by that group, and checked
for leftovers afterwards (read from /proc, so nothing is killed by name)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from rollout_fleet.adapters.shared.processes import hand_over_secret


def start_child(command: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
                cwd: str | Path | None = None) -> subprocess.Popen:
    """Start ``command`` in a new session (its own process group), output to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=None if env is None else dict(env),
                                cwd=cwd, start_new_session=True)


def start_worker(config_path: str | Path, *, secret: str, log_path: str | Path,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """A bare fleet worker on ``config_path``, in its own process group, handed its control
    secret as the fleet's placement hands it: the first line of its standard input."""
    command = [sys.executable, "-m", "rollout_fleet.wiring.worker", "--config", str(config_path),
               "--control-secret-stdin"]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.PIPE, env=None if env is None else dict(env),
                                   start_new_session=True)
    hand_over_secret(process, secret)
    return process


def stop_child(process: subprocess.Popen, *, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
    """Send ``sig`` to the child's process group; SIGKILL the group if it outlives ``timeout_s``."""
    pgid = process.pid
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(pgid)
        process.wait(timeout_s)
    _kill_group(pgid)  # stragglers of the group, if the leader left any
    return process.returncode


def run_to_end(command: Sequence[str], *, log_path: str | Path,
               timeout_s: float = 300.0) -> tuple[int, str]:
    """Run ``command`` in its own process group to its end (stopped, with its group, if it
    outlives ``timeout_s``); its exit code and its output."""
    process = start_child(command, log_path=log_path)
    try:
        code = process.wait(timeout_s)
    finally:
        stop_child(process)
    return code, Path(log_path).read_text()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for pid, state, _ppid, group in _all_processes():
        if group == pgid and state != "Z":
            members.append(pid)
    return members


def leftover_processes(pgids: Iterable[int], parent_pid: int | None = None,
                       wait_s: float = 5.0) -> list[int]:
    """Processes still alive in any of ``pgids`` (or children of ``parent_pid``, when given),
    after waiting up to ``wait_s`` for them to go."""
    pgids = set(pgids)
    parent = -1 if parent_pid is None else parent_pid
    deadline = time.monotonic() + wait_s
    while True:
        left = [pid for pid, state, ppid, group in _all_processes()
                if state != "Z" and pid != os.getpid() and (group in pgids or ppid == parent)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _all_processes():
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields start after the last ")"
        fields = stat[stat.rindex(")") + 2:].split()
        yield int(entry), fields[0], int(fields[1]), int(fields[2])


def own_rss_bytes() -> int:
    """This process's resident memory, from /proc (no psutil needed)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dead_pid() -> int:
    """The pid of a process that has ended (a maker gone, for the orphan sweeps)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
