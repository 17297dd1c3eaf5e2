"""A simulated fleet for load and fault work: N memory-engine workers + one Dynamo frontend,
started as plain child processes (no Ray), each in its own process group, all on 127.0.0.1.

    with SimFleet(run_dir, workers=8, token_delay_s=0.002) as fleet:
        generation = fleet.generation(max_new_tokens=32)
        ...

Every worker serves the in-memory engine through the real Dynamo adapter (the worker entry
point, ``python -m rollout_fleet.wiring.worker``), so a worker costs one small Python process:
8+ fit on a 2-core machine. The fault drills (pause, kill, restart) act on process groups.

``router_mode="kv"`` runs Dynamo's KV router, whose event sockets bind 0.0.0.0: it refuses to
start outside a private network namespace (``unshare -n``; see ``wiring/netns.py``).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_fleet.adapters.dynamo.env import LOOPBACK
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend, stop_process_group
from rollout_fleet.adapters.ray.supervisor import free_port
from rollout_fleet.core.errors import InvalidValue, RolloutFleetError
from rollout_fleet.wiring.netns import in_private_netns

if TYPE_CHECKING:
    from rollout_fleet.adapters.http import HttpSettings
    from rollout_fleet.adapters.nemo_rl import DynamoGeneration
    from rollout_fleet.wiring.driver import WorkerEndpoint

ROUTER_MODES = ("round-robin", "random", "least-loaded", "power-of-two", "kv")
_LOG_TAIL = 3000
# The frontend lists the model once ONE worker registered; the others' registrations reach it
# through the discovery folder within about 0.6 s (FACTS.md).
_DISCOVERY_SETTLE_S = 1.5


class SimFleetError(RolloutFleetError):
    """The simulated fleet did not come up; names the process and carries its log's tail."""


def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now, below 32768 (Dynamo's system port must fit an i16)."""
    return free_port(LOOPBACK)


class SimWorker:
    """One worker process: its config, system URL and process (group leader)."""

    def __init__(self, name: str, system_port: int, config_path: Path, log_path: Path) -> None:
        self.name = name
        self.system_port = system_port
        self.config_path = config_path
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def system_url(self) -> str:
        return f"http://{LOOPBACK}:{self.system_port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise SimFleetError(f"{self.name} is not running")
        return self.process.pid

    def start(self, env: dict[str, str]) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rollout_fleet.wiring.worker", "--config", str(self.config_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        process, self.process = self.process, None
        if process is not None:
            try:  # a paused group cannot act on SIGTERM
                os.killpg(process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            stop_process_group(process, timeout_s)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL:]
        except OSError:
            return "(no log)"


class SimFleet:
    """N memory-engine workers + a Dynamo frontend, as child processes on loopback."""

    def __init__(self, run_dir: str | Path, *, workers: int = 8, token_delay_s: float = 0.0,
                 seed: int = 0, context_length: int = 256, served_model_name: str = "mem",
                 router_mode: str = "round-robin", control_secret: str | None = None,
                 frontend_port: int | None = None, namespace: str = "sim",
                 ready_timeout_s: float = 180.0, extra_env: dict[str, str] | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidValue("workers", workers, "must be an int >= 1")
        if router_mode not in ROUTER_MODES:
            raise InvalidValue("router_mode", router_mode, f"must be one of {', '.join(ROUTER_MODES)}")
        if not isinstance(token_delay_s, (int, float)) or isinstance(token_delay_s, bool) \
                or not token_delay_s >= 0:
            raise InvalidValue("token_delay_s", token_delay_s, "must be a number >= 0")
        self.run_dir = Path(run_dir).resolve()
        self.num_workers = workers
        self.token_delay_s = float(token_delay_s)
        self.seed = seed
        self.context_length = context_length
        self.served_model_name = served_model_name
        self.router_mode = router_mode
        self.namespace = namespace
        self.ready_timeout_s = ready_timeout_s
        # Extra DYN_* settings for every process (e.g. DYN_TCP_REQUEST_TIMEOUT under heavy load).
        self.extra_env = dict(extra_env or {})
        self.secret = control_secret if control_secret is not None else secrets.token_hex(16)
        # Below the ephemeral range (32768+), so no client socket can take it while it restarts.
        self.frontend_port = frontend_port or free_loopback_port()
        self.frontend: DynamoFrontend | None = None
        self.workers: list[SimWorker] = []
        self._stopped = False

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> "SimFleet":
        """Start every worker and the frontend; wait until all serve. Stops all on failure."""
        if self.router_mode == "kv" and not in_private_netns():
            raise SimFleetError(
                "router_mode='kv': Dynamo's KV-event sockets bind 0.0.0.0; run inside a private "
                "network namespace (unshare -n, loopback only), e.g. via "
                "rollout_fleet.wiring.netns.reexec_in_private_netns()")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            model_path = self._model_folder()
            env = self._child_env()
            for index in range(self.num_workers):
                worker = self._worker(index, model_path)
                worker.start(env)
                self.workers.append(worker)
            self.start_frontend()
            deadline = time.monotonic() + self.ready_timeout_s
            for worker in self.workers:
                self._wait_ready(worker, deadline)
            self.frontend.wait_for_model(self.served_model_name,
                                         timeout_s=max(1.0, deadline - time.monotonic()),
                                         workers=[w.process for w in self.workers])
            time.sleep(_DISCOVERY_SETTLE_S)
        except BaseException:
            self.stop()
            raise
        return self

    def _model_folder(self) -> str:
        from rollout_fleet.adapters.memory.model_folder import write_model_folder

        folder = self.run_dir / "model-memory"
        if not (folder / "config.json").exists():
            write_model_folder(folder, context_length=self.context_length)
        return str(folder)

    def _child_env(self) -> dict[str, str]:
        from rollout_fleet.adapters.dynamo.env import dynamo_env

        return {**os.environ, **dynamo_env(self.run_dir), "PYTHONUNBUFFERED": "1", **self.extra_env}

    def _worker(self, index: int, model_path: str) -> SimWorker:
        name = f"sim-worker-{index}"
        taken = {w.system_port for w in self.workers} | {self.frontend_port}
        port = free_loopback_port()
        while port in taken:
            port = free_loopback_port()
        config = {
            "engine": {"kind": "memory", "seed": self.seed, "context_length": self.context_length,
                       "token_delay_s": self.token_delay_s},
            "run_dir": str(self.run_dir), "namespace": self.namespace,
            "served_model_name": self.served_model_name, "model_path": model_path,
            "system_port": port, "control_secret": self.secret,
        }
        config_path = self.run_dir / f"{name}.json"
        config_path.write_text(json.dumps(config, indent=1))
        return SimWorker(name, port, config_path, self.run_dir / f"{name}.log")

    def start_frontend(self, timeout_s: float | None = None) -> DynamoFrontend:
        """Start the frontend (again) on the fleet's port; wait until it lists the model."""
        if self.frontend is not None and self.frontend.process is not None:
            return self.frontend
        extra = {"DYN_ROUTER_MODE": self.router_mode, **self.extra_env}
        self.frontend = DynamoFrontend(self.run_dir, http_port=self.frontend_port, extra_env=extra)
        self.frontend.start()
        if timeout_s is not None:
            self.frontend.wait_for_model(self.served_model_name, timeout_s=timeout_s,
                                         workers=[w.process for w in self.workers if w.process])
        return self.frontend

    def _wait_ready(self, worker: SimWorker, deadline: float) -> None:
        while time.monotonic() < deadline:
            if worker.process is None or worker.process.poll() is not None:
                raise SimFleetError(f"{worker.name} exited while starting; log "
                                    f"{worker.log_path}:\n{worker.log_tail()}")
            if _health_ready(worker.system_url):
                return
            time.sleep(0.2)
        raise SimFleetError(f"{worker.name} was not ready at {worker.system_url} in time; "
                            f"log {worker.log_path}:\n{worker.log_tail()}")

    # -- driver --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.frontend_port}"

    def endpoints(self) -> list["WorkerEndpoint"]:
        from rollout_fleet.wiring.driver import WorkerEndpoint

        return [WorkerEndpoint(w.name, w.system_url) for w in self.workers]

    def generation(self, *, frontend_url: str | None = None, http: "HttpSettings | None" = None,
                   **config: Any) -> "DynamoGeneration":
        """A DynamoGeneration over this fleet (``config``: GenerationConfig fields; model and
        max_model_len default to the fleet's). ``frontend_url``: e.g. a proxy in front of it.
        The generation does not own the fleet."""
        from rollout_fleet.adapters.nemo_rl import GenerationConfig
        from rollout_fleet.wiring.driver import build_generation

        settings = {"model": self.served_model_name, "max_model_len": self.context_length,
                    "max_new_tokens": 16} | config
        return build_generation(GenerationConfig(**settings), frontend_url=frontend_url or self.url,
                                workers=self.endpoints(), control_secret=self.secret, http=http)

    # -- fault drills --------------------------------------------------------------------------
    def pause_worker(self, index: int) -> None:
        """SIGSTOP the worker's process group: it keeps its sockets but answers nothing."""
        self.workers[index].signal_group(signal.SIGSTOP)

    def resume_worker(self, index: int) -> None:
        self.workers[index].signal_group(signal.SIGCONT)

    def kill_frontend(self) -> None:
        """SIGKILL the frontend's process group (no drain, no goodbye)."""
        if self.frontend is None or self.frontend.process is None:
            return
        process, self.frontend.process = self.frontend.process, None
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def process_groups(self) -> list[int]:
        groups = [w.process.pid for w in self.workers if w.process is not None]
        if self.frontend is not None and self.frontend.process is not None:
            groups.append(self.frontend.process.pid)
        return groups

    def pids(self) -> list[int]:
        return self.process_groups()  # each process is its group's leader

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the frontend and every worker by process group. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.frontend is not None:
            self.frontend.stop()
        for worker in self.workers:  # all at once first: each drains in parallel
            if worker.process is not None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        worker.signal_group(sig)
                    except ProcessLookupError:
                        pass
        for worker in self.workers:
            worker.stop()

    def __enter__(self) -> "SimFleet":
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _health_ready(system_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{system_url}/health", timeout=2.0) as answer:
            return json.load(answer).get("status") == "ready"
    except (OSError, ValueError):
        return False
