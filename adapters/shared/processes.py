"""Child processes that lead process groups of their own, stopped by group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

LOG_TAIL_BYTES = 3000

# A signal handler that unwinds a start by raising KeyboardInterrupt (``serve``) may run between
# any two lines of the main thread, so also between a child's fork and the line that records
# the child; such a child would outlive every stop. Blocks that start and record a child hold
# the interrupt until they end.
_held = 0
_pending = False


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Around starting a child and recording it: ``interrupt()`` called meanwhile (in the main
    thread) raises at the end of the block instead. Other threads are not interrupted; for
    them this does nothing."""
    global _held, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        due = _pending and _held == 0
        if due:
            _pending = False
    if due:
        raise KeyboardInterrupt


def interrupt() -> None:
    """For a signal handler: raise KeyboardInterrupt now, or when the ``interrupts_held``
    block the main thread is in ends."""
    global _pending
    if _held:
        _pending = True
        return
    raise KeyboardInterrupt


def stop_process_group(process: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """Stop a child that leads its own process group (``process_group=0`` or
    ``start_new_session=True``), and everything in its group: SIGCONT (a paused group cannot
    act on SIGTERM), SIGTERM, then SIGKILL after ``timeout_s``."""
    pgid = process.pid  # a group leader's group id is its pid
    signal_group(pgid, signal.SIGCONT)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not signal_group(pgid, sig):
            break
        try:
            process.wait(timeout_s)
            break
        except subprocess.TimeoutExpired:
            continue
    signal_group(pgid, signal.SIGKILL)  # the leader may be gone while others in its group linger
    return process.wait()


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def read_tail(path: str | Path, size: int = LOG_TAIL_BYTES) -> str:
    """The last ``size`` bytes of a log, as text; "(no log)" when it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - size))
            return log.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def secret_stdin(secret: str | None) -> int:
    """The ``stdin`` for a child that is handed ``secret`` (a pipe) or nothing (/dev/null)."""
    return subprocess.DEVNULL if secret is None else subprocess.PIPE


def hand_over_secret(process: subprocess.Popen, secret: str | None) -> None:
    """Write ``secret`` as one line to the child's standard input and close the pipe: unlike an
    argument or the environment, no other process of the node can read it there."""
    if secret is None or process.stdin is None:
        return
    try:
        process.stdin.write(secret.encode() + b"\n")
        process.stdin.close()
    except BrokenPipeError:
        pass  # the child is already gone; the fleet reports why from its log


def pid_namespace() -> str:
    """This process's pid namespace (an inode number): a pid names a process only inside it
    (containers sharing /tmp or /dev/shm see other pids)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "unknown"  # no /proc: names still match each other on this host


def open_file_links(pid: int) -> Iterator[tuple[str, str]]:
    """``(fd path, what it links to)`` of each file process ``pid`` holds open (none once it is
    gone; an fd closed meanwhile is passed over)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            yield path, os.readlink(path)
        except OSError:
            continue


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) exists; another user's counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    return True
