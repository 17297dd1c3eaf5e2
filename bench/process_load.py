"""Where a server's CPU went during one round: each process's cores and its busiest thread.

A server that caps its own throughput on a fast accelerator usually does it in one Python
thread: the one that collects the engine's outputs (vLLM's AsyncLLM front, in the fleet's
worker host or in vLLM's API server), or the client's that parses the answers. A round's
figure alone cannot say which; this can: a thread busy for ~1.0 of the round's wall time is
the cap, a process well under a core is not.

    before = snapshot(leaders)          # process-group leaders' PIDs (the servers' own)
    ...                                 # the round
    rows = load_between(before, snapshot(leaders))
    print(load_line(rows))

``leaders`` may also hold this process's own PID (``os.getpid()``): this process and its
descendants are read then (a client beside the servers it drives, or a bare engine's front with
its engine-core processes), not the rest of its group.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

SHOWN_CPU_S = 0.05  # a process that spent less in the round is left out of the rows


def snapshot(leaders: list[int]) -> dict:
    """CPU seconds so far of every process in the process groups led by ``leaders`` (for this
    process's own PID: it and its descendants), and of each of its threads."""
    import psutil

    taken: dict[int, dict] = {}
    for process in _processes(leaders):
        try:
            taken[process.pid] = {"title": _title(process), "cpu_s": sum(process.cpu_times()[:2]),
                                  "threads": _threads(process)}
        except psutil.Error:
            continue  # gone meanwhile
    return {"t": time.monotonic(), "processes": taken}


def load_between(before: dict, after: dict) -> list[dict]:
    """Per process that spent at least ``SHOWN_CPU_S`` between the two snapshots, busiest
    first: its title, CPU seconds, cores (CPU seconds per wall second) and its busiest
    thread's name and share of the wall time (1.0: that thread never rested)."""
    wall = max(after["t"] - before["t"], 1e-9)
    rows = []
    for pid, now in after["processes"].items():
        then = before["processes"].get(pid, {"cpu_s": 0.0, "threads": {}})
        spent = now["cpu_s"] - then["cpu_s"]
        if spent < SHOWN_CPU_S:
            continue
        busiest, name = max((seconds - then["threads"].get(tid, ("", 0.0))[1], label)
                            for tid, (label, seconds) in now["threads"].items())
        rows.append({"process": now["title"], "pid": pid, "cpu_s": round(spent, 2),
                     "cores": round(spent / wall, 2), "busiest_thread": name,
                     "busiest_thread_share": round(busiest / wall, 2)})
    return sorted(rows, key=lambda row: -row["cpu_s"])


def load_line(rows: list[dict], indent: str = "      ") -> str:
    """One line per process: cores, and the busiest thread's share of the round."""
    return "\n".join(f"{indent}{row['cores']:5.2f} cores, busiest thread {row['busiest_thread']!r}"
                     f" {row['busiest_thread_share']:.2f} of the round  {row['process']}"
                     for row in rows)


def leaders_of(processes: list) -> list[int]:
    """The process-group leaders' PIDs of a bench's servers (``Popen`` objects, or the
    frontend's handle, whose ``process`` is one)."""
    return [getattr(process, "process", process).pid for process in processes]


def _processes(leaders: list[int]) -> list:
    import psutil

    me, my_group = os.getpid(), os.getpgid(0)
    chosen = []
    for process in psutil.process_iter():
        try:
            group = os.getpgid(process.pid)
        except ProcessLookupError:
            continue  # gone meanwhile
        if group == my_group:  # this process and the descendants it did not start apart
            wanted = me in leaders and (process.pid == me or _descends_from(process, me))
        else:
            wanted = group in leaders
        if wanted:
            chosen.append(process)
    return chosen


def _descends_from(process, ancestor: int) -> bool:
    import psutil

    try:
        return any(parent.pid == ancestor for parent in process.parents())
    except psutil.Error:
        return False


def _title(process) -> str:
    """Its command line's first words ("python -m rollout_fleet.wiring.worker"), or the title
    vLLM gives its processes ("VLLM::EngineCore")."""
    words = process.cmdline()[:3] or [process.name()]
    return " ".join(words).replace(sys.executable, "python")[:60].strip()


def _threads(process) -> dict[int, tuple[str, float]]:
    return {thread.id: (thread_name(process.pid, thread.id), thread.user_time + thread.system_time)
            for thread in process.threads()}


def thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:  # ended meanwhile
        return str(tid)
