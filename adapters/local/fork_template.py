"""A worker template: one process that imports what every worker imports, then forks workers.

Run by ``ForkTemplate`` (adapters/local/forked.py)::

    python -m rollout_fleet.adapters.local.fork_template

A worker's imports cost about half a second of CPU (asyncio, attrs, Dynamo's bindings, aiohttp,
the project's layers); N workers started at once on C cores pay N x that / C before any is
ready. Forked from this process, a worker starts with them in memory, shared copy-on-write.

It stays single-threaded, so a fork copies no lock held by another thread: nothing here
starts a thread, and what it imports starts none at import (``ForkTemplate`` checks the count
it reports). Its first line on standard input is the JSON list of modules to import; then it
reads one JSON line per launch (``argv`` as ``[python, "-m", module, *args]`` or
``[python, "-c", code, *args]``, ``env``, ``cwd``, ``log_path``, ``secret``) and answers on
standard output with ``{"id": ..., "pid": ...}``; when a worker exits it writes
``{"exited": pid, "code": ...}`` (a negative code: killed by that signal). It exits when its
standard input closes; the workers it forked keep running until stopped.

A forked worker leads a process group of its own in this process's session, has the launch's
environment and working folder, its log as standard output and error, the secret as the one
line of its standard input, and runs its module (or code) as ``__main__``, exiting through the
interpreter as ``python -m`` would (atexit handlers, non-daemon threads).
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import sys
import traceback
import types
from typing import Any

setproctitle: types.ModuleType | None
try:
    import setproctitle
except ImportError:
    setproctitle = None


def main() -> int:
    threads = _preload(json.loads(_first_line()))
    _answer({"ready": True, "threads": threads})
    request = serve_launches()
    if request is None:
        return 0  # standard input closed: the placement is done with this template
    return run_as_worker(request)


def _first_line() -> bytes:
    """Standard input's first line, read unbuffered (the launches after it stay unread)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            break
        line += byte
    return line or b"[]"


def _preload(modules: list[str]) -> int:
    """Import ``modules`` (one that fails is reported on stderr and skipped: the worker will
    import it itself and say why); the count of this process's threads after."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a preload is an optimization, never a failure
            traceback.print_exc()
    gc.collect()
    gc.freeze()  # what is imported stays untouched by collections: its pages stay shared
    return len(os.listdir("/proc/self/task"))


def serve_launches() -> dict[str, Any] | None:
    """Fork a worker per request until standard input closes (None). In a forked child this
    returns that child's request, the template's loop left behind."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    signal.set_wakeup_fd(wake_write)
    pending = b""
    with selectors.DefaultSelector() as selector:
        selector.register(0, selectors.EVENT_READ)
        selector.register(wake_read, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fd == wake_read:
                    os.read(wake_read, 4096)
                    _reap_exited()
                    continue
                data = os.read(0, 1 << 16)
                if not data:
                    return None
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    if _fork(request) == 0:
                        _leave_template(wake_read, wake_write)
                        return request


def _fork(request: dict[str, Any]) -> int:
    """Fork one worker; 0 in the child. The parent hands the secret over and answers."""
    secret_read, secret_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.close(secret_write)
        request["stdin_fd"] = secret_read
        return 0
    try:
        os.setpgid(pid, pid)  # also here: a signal to its group right after this answer finds it
    except OSError:
        pass  # the child did it first, or is gone already
    os.close(secret_read)
    secret = request.get("secret")
    if secret is not None:
        os.write(secret_write, secret.encode() + b"\n")
    os.close(secret_write)
    _answer({"id": request["id"], "pid": pid})
    return pid


def _reap_exited() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _answer(message: dict[str, Any]) -> None:
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(1, data):]


def _leave_template(*fds: int) -> None:
    """In the child: the template's signal wiring undone and its pipes closed."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in fds:
        os.close(fd)


def run_as_worker(request: dict[str, Any]) -> int:
    """Become the requested worker: its files, environment and folder, then its module as
    ``__main__``; its exit code (SystemExit from the module passes through unchanged)."""
    argv = request["argv"]
    _set_title(argv)  # first: setproctitle finds argv's memory by the environment still there
    _standard_files(request["log_path"], request["stdin_fd"],
                    unbuffered=bool(request["env"].get("PYTHONUNBUFFERED")))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    option, target, args = argv[1], argv[2], argv[3:]
    if option == "-c":
        sys.argv = ["-c", *args]
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(compile(target, "<string>", "exec"), main_module.__dict__)
        return 0
    sys.argv = [target, *args]  # runpy sets argv[0] to the module's file
    # Run afresh as __main__ (its imports are the preloaded ones), as ``python -m`` runs it:
    # then a module importing it by name gets a module of its own, not this __main__.
    sys.modules.pop(target, None)
    runpy.run_module(target, run_name="__main__", alter_sys=True)
    return 0


def _set_title(argv: list[str]) -> None:
    """The worker's command line as ``ps`` and /proc show it: the one it would have had
    (tools that find workers by their command keep finding them). Without setproctitle, the
    template's."""
    if setproctitle is not None:
        setproctitle.setproctitle(" ".join(argv))


def _standard_files(log_path: str, stdin_fd: int, unbuffered: bool) -> None:
    """The worker's standard files on its log and its secret's pipe, buffered as a new
    interpreter buffers them for a file (``unbuffered``: as ``PYTHONUNBUFFERED`` makes it)."""
    log = os.open(log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    for target, fd in ((0, stdin_fd), (1, log), (2, log)):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as a new process's: nothing else inherited
    sys.stdin = open(0, closefd=False)
    if unbuffered:
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")
    else:  # stdout in blocks, stderr by lines
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False,
                          errors="backslashreplace")

if __name__ == "__main__":
    sys.exit(main())
