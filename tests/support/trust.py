"""Where a fleet's control secret must never show up, and which processes make up a fleet:
read from /proc and the file system, nothing of the fleet's own bookkeeping trusted."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from tests.support.processes import _all_processes


def descendants(root: int) -> list[int]:
    """Live processes below ``root`` (children, grandchildren, ...), not ``root`` itself."""
    children: dict[int, list[int]] = {}
    for pid, state, ppid, _group in _all_processes():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        below = [c for p in frontier for c in children.get(p, [])]
        found += below
        frontier = below
    return found


def secret_leaks(secret: str, pids: Iterable[int], folders: Iterable[Path]) -> list[str]:
    """Every place the secret can be read: a process's command line or environment, a file
    under ``folders`` (logs, configs, discovery records), named one per entry."""
    needle = secret.encode()
    leaks = []
    for pid in pids:
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as f:
                    if needle in f.read():
                        leaks.append(f"/proc/{pid}/{part}")
            except OSError:
                continue  # gone meanwhile
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file() and not path.is_symlink() and _holds(path, needle):
                leaks.append(str(path))
    return leaks


def open_to_others(run_dir: Path) -> list[str]:
    """The run folder, and the JSON files in it (worker configs, the fleet file), where a user
    other than the owner has any access."""
    entries = [run_dir, *sorted(run_dir.glob("*.json"))]
    return [f"{p} {stat.filemode(p.stat().st_mode)}" for p in entries
            if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO)]


def _holds(path: Path, needle: bytes, chunk: int = 1 << 20) -> bool:
    try:
        with open(path, "rb") as f:
            tail = b""
            while block := f.read(chunk):
                if needle in tail + block:
                    return True
                tail = block[-len(needle):]
    except OSError:
        return False
    return False


def shm_segments_of(pids: Iterable[int]) -> set[str]:
    """The /dev/shm/psm_* files the processes map or hold open now."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                found |= {line.split(maxsplit=5)[5].strip() for line in maps
                          if "/dev/shm/psm_" in line and "(deleted)" not in line}
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/psm_") and "(deleted)" not in target:
                found.add(target)
    return found
