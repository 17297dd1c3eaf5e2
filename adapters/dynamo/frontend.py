"""Start and stop Dynamo's OpenAI frontend (``python -m dynamo.frontend``) as a child process.

The child runs in a process group of its own on 127.0.0.1 with file discovery, so it finds
every worker whose ``DYN_FILE_KV`` is the same folder, and is stopped by its process group. A
fleet across nodes gives it the driver node's cluster address (``host``) and etcd discovery:
workers on other nodes connect back to its response stream there.
It stays in its parent's session on purpose: Linux's autogroup scheduler gives each session a
share of its own, and a frontend in a new session waited 0.3-4.5 s for the CPU at times while
busy-polling vLLM processes ran in the parent's (bench/bench_vllm_frontend.py prints it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

from rollout_fleet.adapters.dynamo.env import LOOPBACK, dynamo_env
from rollout_fleet.adapters.shared import read_tail, stop_process_group
from rollout_fleet.adapters.shared.processes import interrupts_held
from rollout_fleet.core.errors import RolloutFleetError

_LOG_TAIL_BYTES = 4000
_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The frontend's line when it cannot build a registered model (it retries with backoff for
# minutes): a missing or broken chat template, an unreadable tokenizer, ...
_MATERIALISE_FAILED = re.compile(
    r'Model materialization failed.*?group=\["(?P<model>(?:[^"\\]|\\.)*)".*?error="(?P<reason>(?:[^"\\]|\\.)*)"')
# Seen this often in a row, the failure is the model's, not a moment of start-up.
_MATERIALISE_ATTEMPTS = 2


class FrontendError(RolloutFleetError):
    """The frontend did not come up (or list the model) in time; carries its log's tail."""


class ModelRejected(FrontendError):
    """The frontend cannot materialise a registered model; carries the frontend's own reason."""

    def __init__(self, model: str, reason: str, log_path: Path) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"the frontend cannot serve model {model!r}: {reason} (log {log_path})")


class DynamoFrontend:
    """One ``dynamo.frontend`` child process; use as a context manager or start()/stop()."""

    def __init__(self, run_dir: str | Path, *, http_port: int, python: str = sys.executable,
                 log_level: str = "warn", extra_env: Mapping[str, str] | None = None,
                 host: str = LOOPBACK) -> None:
        self.run_dir = Path(run_dir)
        self.http_port = http_port
        self.host = host
        self.python = python
        self.env = {**os.environ, **dynamo_env(self.run_dir, log_level=log_level, host=host),
                    **(extra_env or {})}
        self.log_path = self.run_dir / f"frontend-{http_port}.log"
        self.process: subprocess.Popen | None = None
        self._log_read = 0  # how far rejected_models() has read the log
        self._rejections: dict[str, list[str]] = {}

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"

    def start(self) -> "DynamoFrontend":
        if self.process is not None:
            return self
        (self.run_dir / "home").mkdir(parents=True, exist_ok=True)
        self._log_read = self.log_path.stat().st_size if self.log_path.exists() else 0
        command = [self.python, "-m", "dynamo.frontend",
                   "--http-host", self.host, "--http-port", str(self.http_port)]
        with interrupts_held(), open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            process_group=0, cwd=self.run_dir)
        return self

    def wait_for_model(self, model: str, timeout_s: float = 60.0,
                       workers: Iterable[subprocess.Popen] = ()) -> None:
        """Block until ``model`` is listed at /v1/models; FrontendError (with the log) if not.

        ``workers``: processes expected to register it; one that exits ends the wait at once.
        """
        deadline = time.monotonic() + timeout_s
        listed: list[str] = []
        workers = list(workers)
        while time.monotonic() < deadline:
            for worker in workers:
                if worker.poll() is not None:
                    raise FrontendError(f"worker process {worker.pid} exited with code "
                                        f"{worker.returncode} before {model!r} was listed")
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise FrontendError(f"the frontend is not running (exit code {code}); "
                                    f"log {self.log_path}:\n{self.log_tail()}")
            listed = self.listed_models()
            if model in listed:
                return
            reason = self.rejected_models().get(model)
            if reason is not None:
                raise ModelRejected(model, reason, self.log_path)
            time.sleep(0.1)
        raise FrontendError(
            f"model {model!r} not listed at {self.url}/v1/models within {timeout_s:.0f} s "
            f"(listed: {listed}); is its worker running with DYN_FILE_KV={self.env['DYN_FILE_KV']}? "
            f"log {self.log_path}:\n{self.log_tail()}")

    def wait_for_instances(self, instance_ids: Iterable[int], timeout_s: float = 30.0) -> None:
        """Block until the frontend's discovery holds every one of ``instance_ids`` (the
        workers' Dynamo instance ids): it lists a model once ONE worker registered, and
        routes only to the workers it knows. FrontendError names the ones still missing."""
        wanted = set(instance_ids)
        deadline = time.monotonic() + timeout_s
        while True:
            missing = wanted - self.known_instances()
            if not missing:
                return
            if time.monotonic() > deadline:
                raise FrontendError(f"the frontend at {self.url} did not see instances "
                                    f"{sorted(missing)} within {timeout_s:.0f} s; log "
                                    f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def known_instances(self) -> set[int]:
        """The instance ids of the workers the frontend's discovery holds (its /health)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as answer:
                return {int(i["instance_id"]) for i in json.load(answer).get("instances", [])}
        except (OSError, ValueError, KeyError, TypeError):
            return set()  # not up yet, or a half-written answer

    def listed_models(self) -> list[str]:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2.0) as answer:
                return [m["id"] for m in json.load(answer).get("data", [])]
        except (OSError, ValueError, KeyError, TypeError):
            return []  # not up yet, or a half-written answer

    def rejected_models(self) -> dict[str, str]:
        """Models the frontend failed to materialise in its last attempts, with its reason."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_read)
                data = log.read()
        except OSError:
            return {}
        complete = data.rfind(b"\n") + 1  # a half-written line waits for the next call
        self._log_read += complete
        for line in _ANSI_CODES.sub("", data[:complete].decode("utf-8", "replace")).splitlines():
            found = _MATERIALISE_FAILED.search(line)
            if found:
                self._rejections.setdefault(found["model"], []).append(
                    found["reason"].replace('\\"', '"'))
        return {model: reasons[-1] for model, reasons in self._rejections.items()
                if len(reasons) >= _MATERIALISE_ATTEMPTS and len(set(reasons[-2:])) == 1}

    def log_tail(self) -> str:
        """The end of the frontend's log, without terminal colour codes."""
        return _ANSI_CODES.sub("", read_tail(self.log_path, _LOG_TAIL_BYTES))

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the frontend's process group, SIGKILL it after ``timeout_s``. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        stop_process_group(process, timeout_s)

    def __enter__(self) -> "DynamoFrontend":
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
