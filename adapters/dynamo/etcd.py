"""A single-member etcd on loopback, for Dynamo's etcd discovery (Debian's ``etcd-server``)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from rollout_fleet.adapters.shared import stop_process_group
from rollout_fleet.adapters.shared.processes import interrupts_held
from rollout_fleet.core.errors import RolloutFleetError


class EtcdError(RolloutFleetError):
    """etcd is missing or did not become healthy."""


class LoopbackEtcd:
    def __init__(self, data_dir: str | Path, *, client_port: int, peer_port: int,
                 host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.client_port = client_port
        self.peer_port = peer_port
        self.log_path = self.data_dir.parent / "etcd.log"
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> "LoopbackEtcd":
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdError("etcd is not installed (Debian: apt-get install etcd-server); "
                            "scripts/venv.sh installs it")
        peer = f"http://{self.host}:{self.peer_port}"
        command = [binary, "--name", "rollout-fleet", "--data-dir", str(self.data_dir),
                   "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", f"rollout-fleet={peer}", "--log-level", "warn"]
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with interrupts_held(), open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_healthy(self.process, timeout_s)
        return self

    def _wait_healthy(self, process: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as answer:
                    if b'"true"' in answer.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        self.stop()
        raise EtcdError(f"etcd at {self.endpoint} did not become healthy in {timeout_s:.0f} s:\n{tail}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop_process_group(process, 10.0)
