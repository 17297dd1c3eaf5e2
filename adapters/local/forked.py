"""Workers forked from a template process that has imported what they import (fork_template.py).

``ForkTemplate`` starts the template, asks it for workers and follows their exits, which the
template reports (it is their parent). ``ForkedProcess`` is the placement's handle on one such
worker, with the part of ``subprocess.Popen``'s interface the placement uses.
"""

from __future__ import annotations

import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import IO

from rollout_fleet.adapters.shared.processes import (interrupts_held, process_alive,
                                                    signal_group, stop_process_group)
from rollout_fleet.core.errors import RolloutFleetError

TEMPLATE_MODULE = "rollout_fleet.adapters.local.fork_template"
_ANSWER_TIMEOUT_S = 30.0
_READY_TIMEOUT_S = 120.0  # its imports, on a loaded machine
_WAIT_SLICE_S = 0.5


def forkable(argv: Sequence[str]) -> bool:
    """Whether a launch's command is ``python -m module ...`` or ``python -c code ...`` with
    this interpreter, which the template can run in a child of its own."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] in ("-m", "-c")


class ForkedProcess:
    """A forked worker: its pid, and its exit code once the template has reported it."""

    def __init__(self, pid: int, template: ForkTemplate) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._template = template
        self._exited = threading.Event()

    def poll(self) -> int | None:
        if self.returncode is None and self._template.gone and not process_alive(self.pid):
            self.mark_exited(-signal.SIGKILL)  # its reaper died first: how it ended is unknown
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = _WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            # In slices: should the template die first, poll() finds out how it is now.
            self._exited.wait(min(left, _WAIT_SLICE_S))
        return code

    def mark_exited(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class ForkTemplate:
    """One template process and the workers it forked. ``env``: the environment it imports
    under (a worker gets its launch's own before its code runs; only what the preloaded
    modules read as they are imported was read under this one)."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], log_path: str) -> None:
        self.env = dict(env)
        self.gone = False
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._answers: dict[int, Future[ForkedProcess]] = {}  # request id -> its worker
        self._workers: dict[int, ForkedProcess] = {}  # pid -> a worker not reported exited
        with interrupts_held(), open(log_path or os.devnull, "ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", TEMPLATE_MODULE], env=self.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, process_group=0)
        assert self._process.stdin is not None and self._process.stdout is not None
        self._requests: IO[bytes] = self._process.stdin
        self._send(json.dumps(list(preload)))
        ready = _first_report(self._process.stdout, _READY_TIMEOUT_S)
        if not isinstance(ready, dict) or ready.get("threads") != 1:
            self.close()
            raise RolloutFleetError(f"the worker template did not start single-threaded "
                                    f"within {_READY_TIMEOUT_S:.0f} s (it reported {ready!r}; "
                                    f"log {log_path or '(none)'})")
        self._reader = threading.Thread(target=self._read_reports, args=(self._process.stdout,),
                                        name="fork-template-reports", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: str,
              secret: str | None) -> ForkedProcess:
        request_id = next(self._ids)
        answer: Future[ForkedProcess] = Future()
        with self._lock:
            self._answers[request_id] = answer
        line = json.dumps({"id": request_id, "argv": list(argv), "env": dict(env),
                           "cwd": os.getcwd(), "log_path": log_path, "secret": secret})
        self._send(line)
        try:
            return answer.result(_ANSWER_TIMEOUT_S)
        except FutureTimeout:
            raise RolloutFleetError(f"the worker template (pid {self.pid}) did not fork within "
                                    f"{_ANSWER_TIMEOUT_S:.0f} s") from None

    def _send(self, line: str) -> None:
        try:
            self._requests.write(line.encode() + b"\n")
            self._requests.flush()
        except (BrokenPipeError, ValueError):
            raise RolloutFleetError(f"the worker template (pid {self.pid}) is gone") from None

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the template's input (it exits; its workers are stopped by the placement)."""
        try:
            self._requests.close()
        except BrokenPipeError:
            pass
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_process_group(self._process, timeout_s)
        signal_group(self._process.pid, signal.SIGKILL)  # nothing of it may linger

    def _read_reports(self, reports: IO[bytes]) -> None:
        """A pid answered becomes its worker here, before any later line (its exit among
        them) is read: the template writes them in that order."""
        for line in reports:
            message = json.loads(line)
            if "exited" in message:
                self._on_exit(message["exited"], message["code"])
            else:
                self._on_fork(message["id"], message["pid"])
        self.gone = True
        with self._lock:
            waiting, self._answers = list(self._answers.values()), {}
        for answer in waiting:
            answer.set_exception(RolloutFleetError(f"the worker template (pid {self.pid}) is gone"))

    def _on_fork(self, request_id: int, pid: int) -> None:
        worker = ForkedProcess(pid, self)
        with self._lock:
            self._workers[pid] = worker
            answer = self._answers.pop(request_id)
        answer.set_result(worker)

    def _on_exit(self, pid: int, code: int) -> None:
        with self._lock:
            worker = self._workers.pop(pid, None)
        if worker is not None:
            worker.mark_exited(code)


def _first_report(reports: IO[bytes], timeout_s: float) -> object:
    """The template's first line, parsed; None when none came within ``timeout_s``."""
    with selectors.DefaultSelector() as selector:
        selector.register(reports, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return None
    try:
        return json.loads(reports.readline() or b"null")
    except ValueError:
        return None


def launch_env(env: Mapping[str, str], own_keys: Sequence[str]) -> dict[str, str]:
    """What of a launch's environment its template imports under: all but each worker's own."""
    return {key: value for key, value in env.items() if key not in own_keys}
