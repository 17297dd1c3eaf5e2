"""How a worker process ends: its stop deadline, a hard exit, and what is left of its children."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path

logger = logging.getLogger("rollout_fleet.worker")

# How long after its stop deadline a worker still running is ended by the kernel's alarm.
ALARM_AFTER_DEADLINE_S = 5


def kill_child_processes() -> None:
    """SIGKILL every process this one started, and theirs (Linux): a hung engine process may
    be stopped or deaf to SIGTERM."""
    for pid in reversed(_descendants(os.getpid())):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found.extend(children)
            queue.extend(children)
    return found


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: after an engine died, it waited 4-20 s (more
    under load) on what was left of the dead engine's client, while the fleet saw the worker
    as alive. Dynamo has unregistered it and the engine is closed; nothing else needs it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ExitDeadline:
    """Exit the process ``grace_s`` after it is armed, if it is still running by then. A thread
    of its own keeps the time, not the event loop: a stop stuck on the loop (or a SIGTERM that
    reached only this process's handler) still ends by the deadline. Behind it, the kernel's
    alarm (SIGALRM, whose default action ends the process) a few seconds later: it needs no
    Python thread to run, should one hold the interpreter's lock. Arming twice keeps the first
    deadline."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def arm(self, why: str) -> None:
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Timer(self.grace_s, self._expire, args=(why,))
            self._timer.daemon = True
            self._timer.name = "worker-exit-deadline"
            self._timer.start()
            if signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:  # nobody else's alarm
                signal.alarm(math.ceil(self.grace_s) + ALARM_AFTER_DEADLINE_S)

    def _expire(self, why: str) -> None:
        logger.error("worker: still running %.0f s after %s; exiting now", self.grace_s, why)
        exit_now(128 + signal.SIGTERM)


# This process's deadline once the worker runs; armed on SIGTERM, or when its engine is lost.
_PROCESS_DEADLINE: list[ExitDeadline] = []


def set_exit_deadline(grace_s: float) -> ExitDeadline:
    """This process's stop deadline (``arm_exit_deadline`` arms it)."""
    _PROCESS_DEADLINE[:] = [ExitDeadline(grace_s)]
    return _PROCESS_DEADLINE[0]


def arm_exit_deadline(why: str) -> None:
    for deadline in _PROCESS_DEADLINE:
        deadline.arm(why)
