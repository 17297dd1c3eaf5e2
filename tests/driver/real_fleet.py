"""A small real fleet on loopback: Dynamo's frontend and N worker processes with the in-memory
engine, each worker in its own process group, all stopped by group (checked for leftovers)."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

from tests.support import free_port, leftover_processes, start_child, stop_child

SERVED_MODEL = "mem"
CONTROL_SECRET = "driver-test-secret"
ENGINE_SEED = 0
CONTEXT_LENGTH = 256


class RealFleet:
    def __init__(self, run_dir: Path, num_workers: int = 2, *, token_delay_s: float = 0.0) -> None:
        from rollout_fleet.adapters.dynamo import DynamoFrontend  # fails loudly when missing

        self.run_dir = Path(run_dir)
        self.workers = []
        self.system_urls: list[str] = []
        self.frontend = DynamoFrontend(self.run_dir, http_port=free_port())
        self._num_workers = num_workers
        self._token_delay_s = token_delay_s

    @property
    def url(self) -> str:
        return self.frontend.url

    def start(self) -> "RealFleet":
        try:
            # The first worker writes the model folder; the others reuse it (no write race).
            self._start_worker(0, model_path=None)
            self.frontend.start()
            self.frontend.wait_for_model(SERVED_MODEL, timeout_s=90, workers=self.workers)
            for index in range(1, self._num_workers):
                self._start_worker(index, model_path=str(self.run_dir / "model-memory"))
            for index, url in enumerate(self.system_urls):
                self._wait_ready(index, url)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_worker(self, index: int, model_path: str | None) -> None:
        port = free_port(below=32768)
        config = {
            "engine": {"kind": "memory", "seed": ENGINE_SEED, "context_length": CONTEXT_LENGTH,
                       "token_delay_s": self._token_delay_s},
            "run_dir": str(self.run_dir), "namespace": "driver", "served_model_name": SERVED_MODEL,
            "model_path": model_path, "system_port": port, "control_secret": CONTROL_SECRET,
        }
        path = self.run_dir / f"worker-{index}.json"
        path.write_text(json.dumps(config))
        self.workers.append(start_child(
            [sys.executable, "-m", "rollout_fleet.wiring.worker", "--config", str(path)],
            log_path=self.run_dir / f"worker-{index}.log"))
        self.system_urls.append(f"http://127.0.0.1:{port}")

    def _wait_ready(self, index: int, url: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.workers[index].poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if json.load(answer).get("status") == "ready":
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        log = (self.run_dir / f"worker-{index}.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"worker {index} did not become ready; log tail:\n{log}")

    def stop(self) -> None:
        groups = [w.pid for w in self.workers]
        if self.frontend.process is not None:
            groups.append(self.frontend.process.pid)
        for worker in self.workers:
            stop_child(worker)
        self.frontend.stop()
        left = leftover_processes(groups)
        assert left == [], f"processes left behind by the driver's fleet: {left}"
