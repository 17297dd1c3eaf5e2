"""The fleet: N workers placed with Ray, one Dynamo frontend owned by the driver, discovery
between them, and a shutdown that leaves nothing behind.

    fleet = Fleet.start(parse_config({...}))     # or load_config("fleet.toml")
    try:
        generation = fleet.generation()           # DynamoGeneration over this fleet
        ...
    finally:
        fleet.shutdown()                          # safe to repeat; also runs on a failed start
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rollout_fleet.adapters.dynamo.env import dynamo_env
from rollout_fleet.adapters.dynamo.etcd import LoopbackEtcd
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend
from rollout_fleet.adapters.http.settings import HttpSettings
from rollout_fleet.adapters.ray.placement import RayPlacement
from rollout_fleet.adapters.ray.supervisor import free_port
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.ports.placement import WorkerHandle, WorkerLaunch
from rollout_fleet.wiring.config import ConfigError, FleetConfig
from rollout_fleet.wiring.netns import in_private_netns

if TYPE_CHECKING:
    from rollout_fleet.adapters.nemo_rl import DynamoGeneration

logger = logging.getLogger("rollout_fleet.fleet")
_LOG_TAIL = 3000


class FleetStartError(RolloutFleetError):
    """The fleet did not come up; names the worker and carries the tail of its log."""


@attrs.define
class Fleet:
    config: FleetConfig
    run_dir: Path
    secret: str
    model_path: str
    frontend: DynamoFrontend | None = None
    placement: RayPlacement | None = None
    etcd: LoopbackEtcd | None = None
    workers: list[WorkerHandle] = attrs.field(factory=list)
    _stopped: bool = False
    _own_run_dir: tempfile.TemporaryDirectory | None = None

    # -- start ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: FleetConfig) -> "Fleet":
        """Start everything; on any failure, stop what was started and raise."""
        _check_network(config)
        own = None if config.run_dir else tempfile.TemporaryDirectory(prefix="rollout-fleet-")
        run_dir = Path(config.run_dir or own.name).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        fleet = cls(config, run_dir, secrets.token_hex(16), "", own_run_dir=own)
        try:
            fleet._start()
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    def _start(self) -> None:
        self.model_path = self._model_folder()
        discovery_env = self._discovery_env()
        self.placement = RayPlacement(address=self.config.ray_address, bundle=self.config.bundle,
                                      bind_host=self.config.bind_host,
                                      ready_timeout_s=self.config.timeouts.start_s)
        self.workers = list(self.placement.launch([self._launch(i, discovery_env)
                                                   for i in range(self.config.num_workers)]))
        port = self.config.frontend_port or free_port(self.config.bind_host)
        self.frontend = DynamoFrontend(self.run_dir, http_port=port, extra_env={
            **discovery_env, "DYN_ROUTER_MODE": self.config.router}).start()
        deadline = time.monotonic() + self.config.timeouts.start_s
        for worker in self.workers:
            self._wait_worker_ready(worker, deadline)
        self.frontend.wait_for_model(self.config.served_model_name,
                                     timeout_s=max(1.0, deadline - time.monotonic()))

    def _model_folder(self) -> str:
        if self.config.model != "tiny":
            return str(Path(self.config.model).resolve())
        if self.config.engine.get("kind") == "memory":
            return ""  # the memory engine writes its own folder in each worker
        from rollout_fleet.adapters.tiny_model import build_tiny_model

        folder = self.run_dir / "tiny-model"
        if not (folder / "config.json").exists():
            build_tiny_model(folder)
        return str(folder)

    def _discovery_env(self) -> dict[str, str]:
        if self.config.discovery == "file":
            return {}
        endpoint = self.config.etcd_endpoint
        if endpoint is None:
            host = self.config.bind_host
            self.etcd = LoopbackEtcd(self.run_dir / "etcd" / "data", host=host,
                                     client_port=free_port(host), peer_port=free_port(host)).start()
            endpoint = self.etcd.endpoint
        return {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": endpoint}

    def _launch(self, index: int, discovery_env: dict[str, str]) -> WorkerLaunch:
        name = f"worker-{index}"
        engine = dict(self.config.engine)
        if self.config.device == "gpu" and engine.get("kind") == "vllm":
            engine.setdefault("device", "cuda")
        if self.config.device == "cpu" and engine.get("kind") == "vllm" \
                and self.config.ray_address is None:
            # Left alone, every vLLM engine on this host binds its model threads to the same
            # core and the workers take turns; each gets cores of its own instead.
            engine.setdefault("cpu_cores", cores_for_worker(
                sorted(os.sched_getaffinity(0)), self.config.num_workers, index))
        kv_routing = self.config.router == "kv"
        if kv_routing and engine.get("kind") == "vllm":
            engine.setdefault("kv_events_port", free_port(self.config.bind_host))
        worker_config = {
            "engine": engine, "run_dir": str(self.run_dir), "kv_routing": kv_routing,
            "collective_backend": self.collective_backend,
            "namespace": "fleet", "served_model_name": self.config.served_model_name,
            "model_path": self.model_path or None, "control_secret": self.secret,
            "worker_id": name, "env": discovery_env,
        }
        config_path = self.run_dir / f"{name}.json"
        config_path.write_text(json.dumps(worker_config, indent=1))
        env = {**dynamo_env(self.run_dir), **discovery_env, "PYTHONUNBUFFERED": "1"}
        return WorkerLaunch(name=name, argv=(sys.executable, "-m", "rollout_fleet.wiring.worker",
                                             "--config", str(config_path)),
                            env=env, log_path=str(self.run_dir / f"{name}.log"),
                            port_env=("DYN_SYSTEM_PORT",))

    def _wait_worker_ready(self, worker: WorkerHandle, deadline: float) -> None:
        url = self.control_url(worker)
        while time.monotonic() < deadline:
            if not self.placement.alive().get(worker.name, False):
                raise FleetStartError(f"{worker.name} exited while starting; "
                                      f"log {worker.log_path}:\n{_tail(worker.log_path)}")
            try:
                call_control(url, "stats", self.secret, timeout_s=2.0)
                return
            except (OSError, ValueError):
                time.sleep(0.25)
        raise FleetStartError(f"{worker.name} did not answer at {url} within "
                              f"{self.config.timeouts.start_s:.0f} s; log {worker.log_path}:\n"
                              f"{_tail(worker.log_path)}")

    # -- running -------------------------------------------------------------------------------
    @property
    def frontend_url(self) -> str:
        return self.frontend.url

    @property
    def collective_backend(self) -> str:
        """What the refit group runs on: NCCL between GPUs, gloo between CPUs."""
        return "nccl" if self.config.device == "gpu" else "gloo"

    def control_url(self, worker: WorkerHandle) -> str:
        return f"http://{worker.node_ip}:{worker.ports['DYN_SYSTEM_PORT']}"

    @property
    def control_urls(self) -> dict[str, str]:
        return {w.name: self.control_url(w) for w in self.workers}

    def generation(self, **overrides: Any) -> "DynamoGeneration":
        """A DynamoGeneration over this fleet (``overrides``: GenerationConfig fields).

        It does not own the fleet: ``fleet.shutdown()`` stops the fleet.
        """
        from rollout_fleet.adapters.nemo_rl import GenerationConfig
        from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation

        c = self.config
        settings = {
            "model": c.served_model_name, "max_model_len": c.max_model_len,
            "max_new_tokens": c.max_new_tokens, "stop_strings": tuple(c.stop_strings),
            "context_limit_policy": c.context_limit_policy, "max_concurrency": c.max_in_flight,
            "retry": c.retry.policy(), "ranks_per_worker": c.ranks_per_worker,
            "sender_spec": c.sender_spec, "control_timeout_s": c.timeouts.refit_s,
        } | overrides
        return build_generation(
            GenerationConfig(**settings), frontend_url=self.frontend_url,
            workers=[WorkerEndpoint(name, url) for name, url in self.control_urls.items()],
            control_secret=self.secret, http=http_settings(c, settings["max_concurrency"]))

    def dead_workers(self) -> list[str]:
        return sorted(name for name, alive in self.placement.alive().items() if not alive)

    def kill_worker(self, name: str) -> None:
        """Kill one worker's process now (fault drills)."""
        self.placement.kill(name)

    # -- stop ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the frontend, the workers and their engines, the placement group, etcd. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for stop in (self._stop_frontend, self._stop_workers, self._stop_etcd):
            try:
                stop()
            except Exception:  # noqa: BLE001 - stop the rest, then report
                logger.exception("fleet shutdown step %s failed", stop.__name__)
        if self._own_run_dir is not None:
            self._own_run_dir.cleanup()

    def _stop_frontend(self) -> None:
        if self.frontend is not None:
            self.frontend.stop(self.config.timeouts.shutdown_s)

    def _stop_workers(self) -> None:
        if self.placement is not None:
            self.placement.stop()

    def _stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.shutdown()


def http_settings(config: FleetConfig, max_in_flight: int) -> HttpSettings:
    """The driver's client: one connection per rollout in flight, the config's timeouts (one
    attempt may take ``request_s`` in all; a read may wait as long)."""
    t = config.timeouts
    return HttpSettings(max_in_flight=max_in_flight, connect_timeout_s=t.connect_s,
                        read_timeout_s=t.request_s, request_timeout_s=t.request_s)


def cores_for_worker(cores: list[int], num_workers: int, index: int) -> list[int]:
    """Worker ``index``'s share of ``cores``: an equal contiguous slice, or one core (shared
    round-robin) when there are more workers than cores."""
    share = len(cores) // num_workers
    if share == 0:
        return [cores[index % len(cores)]]
    return cores[index * share:(index + 1) * share]


def call_control(control_url: str, name: str, secret: str, body: dict | None = None,
                 timeout_s: float = 30.0) -> dict[str, Any]:
    """A blocking control call (start-up checks, the CLI); the driver uses the http adapter."""
    payload = json.dumps({**(body or {}), "control_secret": secret}).encode()
    request = urllib.request.Request(f"{control_url}/engine/control/{name}", data=payload,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        data = json.loads(answer.read())
    if not isinstance(data, dict) or data.get("status") != "ok":
        raise ValueError(f"control {name} answered {data!r:.300}")
    return data


def _check_network(config: FleetConfig) -> None:
    if config.ray_address is None and not in_private_netns():
        raise ConfigError(
            "a local Ray cluster binds every interface; start the fleet inside a private network "
            "namespace (the rollout-fleet command does this itself; or run under `unshare -n`), "
            "or join a cluster with ray_address")


def _tail(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")[-_LOG_TAIL:]
    except OSError:
        return "(no log)"
