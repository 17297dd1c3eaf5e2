"""The fleet: N workers started by a placement, one Dynamo frontend owned by the driver,
discovery between them, and a shutdown that leaves nothing behind. The one composition root:
the CLI, the demo, the benches and the tests all start their fleets here.

    fleet = Fleet.start(parse_config({...}))     # or load_config("fleet.toml")
    try:
        generation = fleet.generation()           # DynamoGeneration over this fleet
        ...
    finally:
        fleet.shutdown()                          # safe to repeat; also runs on a failed start

The placement is a port: ``placement = "ray"`` (a placement group, one node or a cluster) or
``"local"`` (child processes on this machine) in the config, or any ``Placement`` passed in.

Trust: the fleet makes a fresh control secret; each worker gets it on its standard input from
the placement (never in a file, an argument, the environment or a Ray object in the clear),
and the run folder is the owner's alone (0700; the worker configs in it 0600).

Across nodes (``ray_address`` and a ``bind_host`` on the cluster network: ``spans_nodes``) the
frontend, etcd and the trainer's end of the refit group stay on the driver's node at
``bind_host``; each worker binds its own node's cluster address, which Ray finds on that node.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rollout_fleet.adapters.dynamo.env import dynamo_env
from rollout_fleet.adapters.dynamo.etcd import LoopbackEtcd
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend
from rollout_fleet.adapters.http.settings import HttpSettings
from rollout_fleet.adapters.shared import free_port, read_tail
from rollout_fleet.core.errors import InvalidValue, RolloutFleetError
from rollout_fleet.ports.placement import Placement, WorkerHandle, WorkerLaunch
from rollout_fleet.wiring.config import ConfigError, FleetConfig, fleet_facts
from rollout_fleet.wiring.engines import engine_kind, without_kind
from rollout_fleet.wiring.network import check_network
from rollout_fleet.wiring.worker import BIND_HOST_ENV, FAILURE_MARK
from rollout_fleet.wiring.worker_config import WorkerConfig

if TYPE_CHECKING:
    from rollout_fleet.adapters.nemo_rl import DynamoGeneration
    from rollout_fleet.wiring.driver import WorkerEndpoint

logger = logging.getLogger("rollout_fleet.fleet")
SYSTEM_PORT = "DYN_SYSTEM_PORT"  # each worker's system server: health, controls, metrics
_WATCH_S = 1.0  # how often the fleet looks for lost workers
_REPLACE_BACKOFF_MAX_S = 60.0


class FleetStartError(RolloutFleetError):
    """The fleet did not come up; names the worker, its own error and its log."""


def placement_for(config: FleetConfig, groups: Sequence[Any] = ()) -> Placement:
    """The placement the config names; ``groups``: Ray placement groups reserved already, one
    bundle per engine rank, that the workers go into (none of its own is then reserved)."""
    if config.placement == "local":
        from rollout_fleet.adapters.local import LocalPlacement

        return LocalPlacement(bind_host=config.bind_host, stop_grace_s=config.timeouts.shutdown_s)
    from rollout_fleet.adapters.ray import RayPlacement

    return RayPlacement(address=config.ray_address, bundle=config.bundle,
                        strategy=config.placement_strategy, bind_host=config.bind_host,
                        bind_per_node=config.spans_nodes, ready_timeout_s=config.timeouts.start_s,
                        groups=groups, bundles_per_worker=config.ranks_per_worker if groups else 1)


@attrs.define
class Fleet:
    config: FleetConfig
    placement: Placement
    run_dir: Path
    secret: str = attrs.field(repr=False)
    model_path: str = ""
    frontend: DynamoFrontend | None = None
    etcd: LoopbackEtcd | None = None
    workers: list[WorkerHandle] = attrs.field(factory=list)
    _discovery_env: dict[str, str] = attrs.field(factory=dict)
    _stopped: bool = False
    _own_run_dir: tempfile.TemporaryDirectory | None = None
    # Guards the worker lists below: a replacement may be added from the watcher's thread.
    _workers_lock: threading.Lock = attrs.field(factory=threading.Lock)
    _replaced: set[str] = attrs.field(factory=set)  # lost workers a replacement was started for
    _slots: dict[str, int] = attrs.field(factory=dict)  # worker -> its share of this host's cores
    _starting: set[str] = attrs.field(factory=set)  # added workers not registered yet
    _instances: dict[str, int] = attrs.field(factory=dict)  # worker -> its Dynamo instance id
    _forgotten: set[str] = attrs.field(factory=set)  # lost workers taken out of discovery
    _killed_lost: set[str] = attrs.field(factory=set)  # lost workers whose group was killed
    _stopping: threading.Event = attrs.field(factory=threading.Event)
    _watcher: threading.Thread | None = None

    # -- start ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: FleetConfig, placement: Placement | None = None) -> "Fleet":
        """Start everything; on any failure, stop what was started and raise."""
        check_network(config)
        own = None if config.run_dir else tempfile.TemporaryDirectory(prefix="rollout-fleet-")
        run_dir = private_folder(Path(config.run_dir or own.name).resolve())
        fleet = cls(config, placement or placement_for(config), run_dir, secrets.token_hex(16),
                    own_run_dir=own)
        try:
            fleet._start()
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    def _start(self) -> None:
        self.model_path = self._model_folder()
        self._discovery_env = self._start_discovery()
        self.workers = list(self.placement.launch([self._launch(i)
                                                   for i in range(self.config.num_workers)]))
        self._slots = {w.name: i for i, w in enumerate(self.workers)}
        port = self.config.frontend_port or free_port(self.config.bind_host)
        self.frontend = DynamoFrontend(self.run_dir, http_port=port, extra_env=self._frontend_env(),
                                       host=self.config.bind_host)
        self.frontend.start()
        deadline = time.monotonic() + self.config.timeouts.start_s
        for worker in self.workers:
            self._wait_worker_ready(worker, deadline)
        self.frontend.wait_for_model(self.config.served_model_name,
                                     timeout_s=max(1.0, deadline - time.monotonic()))
        self.frontend.wait_for_instances(self._instances.values(),
                                         timeout_s=max(1.0, deadline - time.monotonic()))
        self._watcher = threading.Thread(target=self._watch_workers, name="fleet-watcher",
                                         daemon=True)
        self._watcher.start()

    def _model_folder(self) -> str:
        if self.config.model != "tiny":
            return str(Path(self.config.model).resolve())
        engine = self.config.engine
        own = engine_kind(engine["kind"]).model_folder(without_kind(engine), self.run_dir)
        if own is not None:
            return own
        from rollout_fleet.adapters.tiny_model import build_tiny_model

        folder = self.run_dir / "tiny-model"
        if not (folder / "config.json").exists():
            build_tiny_model(folder)
        return str(folder)

    def _start_discovery(self) -> dict[str, str]:
        if self.config.discovery == "file":
            return {}
        endpoint = self.config.etcd_endpoint
        if endpoint is None:
            host = self.config.bind_host
            # Recorded before it starts, so that a start interrupted while it waits stops it.
            self.etcd = LoopbackEtcd(self.run_dir / "etcd" / "data", host=host,
                                     client_port=free_port(host), peer_port=free_port(host))
            self.etcd.start()
            endpoint = self.etcd.endpoint
        return {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": endpoint}

    def _frontend_env(self) -> dict[str, str]:
        return {"DYN_ROUTER_MODE": self.config.router, **self._discovery_env, **self.config.env}

    def worker_config(self, index: int, *, joins_running: bool = False,
                      slot: int | None = None) -> WorkerConfig:
        """What worker ``index`` is told (python -m rollout_fleet.wiring.worker --config).
        ``joins_running``: it joins a fleet that may have been refit, so it serves only after
        its first refit. ``slot``: whose share of this host's cores it takes (a replacement
        takes the lost worker's)."""
        kind_name = self.config.engine["kind"]
        slot = (index if slot is None else slot) % self.config.num_workers
        engine = {"kind": kind_name, **engine_kind(kind_name).worker_options(
            without_kind(self.config.engine), fleet_facts(self.config), slot=slot,
            free_port=lambda: free_port(self.config.bind_host))}
        kv_routing = self.config.router == "kv"
        return WorkerConfig(
            engine=engine, run_dir=str(self.run_dir), kv_routing=kv_routing,
            collective_backend=self.collective_backend,
            namespace="fleet", served_model_name=self.config.served_model_name,
            model_path=self.model_path or None,
            env={**self._discovery_env, **self.config.env},
            hold_until_refit=joins_running, hang_timeout_s=self.config.hang_timeout_s)

    def _launch(self, index: int, *, joins_running: bool = False, slot: int | None = None,
                in_place_of: str = "") -> WorkerLaunch:
        name = worker_name(index)
        config = self.worker_config(index, joins_running=joins_running, slot=slot)
        config_path = write_private(self.run_dir / f"{name}.json", config.to_json())
        env = {**dynamo_env(self.run_dir), **self._discovery_env, **self.config.env,
               "PYTHONUNBUFFERED": "1"}
        return WorkerLaunch(name=name, argv=(sys.executable, "-m", "rollout_fleet.wiring.worker",
                                             "--config", str(config_path), "--control-secret-stdin"),
                            env=env, log_path=str(self.run_dir / f"{name}.log"),
                            port_env=(SYSTEM_PORT,), secret=self.secret, host_env=BIND_HOST_ENV,
                            in_place_of=in_place_of)

    def _wait_worker_ready(self, worker: WorkerHandle, deadline: float) -> None:
        url = self.control_url(worker)
        while time.monotonic() < deadline and not self._stopping.is_set():
            if not self.placement.alive().get(worker.name, False):
                raise FleetStartError(f"{worker.name} exited while starting: "
                                      f"{worker_failure(worker.log_path)} (log {worker.log_path})")
            if _health_ready(url):
                self._instances[worker.name] = call_control(url, "stats", self.secret)["instance_id"]
                return
            time.sleep(0.25)
        raise FleetStartError(f"{worker.name} was not ready at {url} within "
                              f"{self.config.timeouts.start_s:.0f} s (log {worker.log_path}):\n"
                              f"{read_tail(worker.log_path)}")

    # -- joining a running fleet -----------------------------------------------------------------
    def add_worker(self, *, replacing: str | None = None) -> WorkerHandle:
        """Start one more worker (``replacing``: in place of that lost worker, in its
        reservation and on its share of the cores) and wait until it is registered. It serves
        nothing yet: drivers from ``generation()`` take it in when the trainer next asks
        ``get_inference_world_size()``, and it serves once the next update has loaded the
        current weights on it."""
        with self._workers_lock:
            if replacing is not None and replacing not in self._slots:
                raise InvalidValue("replacing", replacing, f"no such worker; the fleet has "
                                   f"{sorted(self._slots)}")
            index = len(self._slots)  # every name ever used counts: names are never reused
            slot = self._slots[replacing] if replacing is not None else index
            self._slots[worker_name(index)] = slot
            self._starting.add(worker_name(index))  # neither lost nor live until registered
            if replacing is not None:
                self._replaced.add(replacing)
        try:  # the placement may wait for resources: nothing else waits for it meanwhile
            worker, = self.placement.launch([self._launch(index, joins_running=True, slot=slot,
                                                          in_place_of=replacing or "")])
        except BaseException:
            self._replaced.discard(replacing)  # a later round tries again
            self._starting.discard(worker_name(index))
            raise
        with self._workers_lock:
            self.workers.append(worker)
        try:
            self._wait_worker_ready(worker, time.monotonic() + self.config.timeouts.start_s)
        except BaseException:
            self.placement.kill(worker.name)  # stopped: it counts as lost, not as starting
            raise
        finally:
            self._starting.discard(worker.name)
        logger.warning("%s joined the fleet%s; it serves after its first refit", worker.name,
                       f" in place of {replacing}" if replacing else "")
        return worker

    def replace_lost_workers(self, lost: list[str] | None = None) -> list[WorkerHandle]:
        """A replacement for every lost worker (``lost``: ``dead_workers()`` when not given)
        that has none yet (see ``add_worker``)."""
        lost = self.dead_workers() if lost is None else lost
        waiting = [name for name in lost if name not in self._replaced]
        return [self.add_worker(replacing=name) for name in waiting]

    def _watch_workers(self) -> None:
        """Every second: take each newly lost worker out of Dynamo's discovery, and (with
        ``replace_lost_workers = true``) start its replacement. A replacement that fails to
        start is lost too: the next try waits longer each time."""
        next_replacement = 0.0
        backoff_s = _WATCH_S
        while not self._stopping.wait(_WATCH_S):
            try:
                lost = self.dead_workers()  # the placement asked once a round
                self._forget_lost_in_discovery(lost)
                self._kill_what_is_left_of(lost)
                if self.config.replace_lost_workers and time.monotonic() >= next_replacement:
                    self.replace_lost_workers(lost)
                    backoff_s = _WATCH_S
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                if self._stopping.is_set():
                    return
                backoff_s = min(2 * backoff_s, _REPLACE_BACKOFF_MAX_S)
                next_replacement = time.monotonic() + backoff_s
                logger.exception("watching the workers failed; next replacement try in %.0f s",
                                 backoff_s)

    def _kill_what_is_left_of(self, lost: list[str]) -> None:
        """SIGKILL each lost worker's process group once: a worker that left because its engine
        hung may leave that engine's process behind, stopped or deaf to SIGTERM, holding its
        memory and devices (a replacement needs them)."""
        for name in lost:
            if name in self._killed_lost:
                continue
            self._killed_lost.add(name)
            try:
                self.placement.kill(name)
            except Exception as exc:  # noqa: BLE001 - its node may be gone with it
                logger.info("%s: nothing of it could be killed (%s: %s)", name,
                            type(exc).__name__, exc)

    def _forget_lost_in_discovery(self, lost: list[str]) -> None:
        """The frontend drops a lost worker at once, not when its registration expires."""
        from rollout_fleet.adapters.dynamo.discovery import forget_instance

        for name in lost:
            if name in self._forgotten or name not in self._instances:
                continue
            self._forgotten.add(name)
            etcd = self._discovery_env.get("ETCD_ENDPOINTS", "").split(",")[0] or None
            if forget_instance(self._instances[name], etcd_endpoint=etcd,
                               file_kv=None if etcd else self.run_dir / "discovery"):
                logger.warning("%s is lost: taken out of discovery", name)

    # -- running -------------------------------------------------------------------------------
    @property
    def frontend_url(self) -> str:
        return self.frontend.url

    @property
    def collective_backend(self) -> str:
        """What the refit group runs on: NCCL between GPUs, gloo between CPUs (or as
        ``refit.backend`` says)."""
        if self.config.refit.backend != "auto":
            return self.config.refit.backend
        return "nccl" if self.config.device == "gpu" else "gloo"

    def control_url(self, worker: WorkerHandle) -> str:
        return f"http://{worker.node_ip}:{worker.ports[SYSTEM_PORT]}"

    @property
    def control_urls(self) -> dict[str, str]:
        with self._workers_lock:
            return {w.name: self.control_url(w) for w in self.workers}

    def endpoints(self, *, live_only: bool = False) -> list["WorkerEndpoint"]:
        """Every worker's endpoint; ``live_only``: those registered and not lost."""
        from rollout_fleet.wiring.driver import WorkerEndpoint

        left_out = (set(self.dead_workers()) | self._starting) if live_only else set()
        return [WorkerEndpoint(name, url) for name, url in self.control_urls.items()
                if name not in left_out]

    def generation(self, *, frontend_url: str | None = None, http: "HttpSettings | None" = None,
                   **overrides: Any) -> "DynamoGeneration":
        """A DynamoGeneration over this fleet (``overrides``: GenerationConfig fields;
        ``frontend_url``: e.g. a proxy in front of the frontend).

        It does not own the fleet: ``fleet.shutdown()`` stops the fleet.
        """
        from rollout_fleet.adapters.nemo_rl import GenerationConfig
        from rollout_fleet.wiring.driver import build_generation

        c = self.config
        settings = {
            "model": c.served_model_name, "max_model_len": c.max_model_len,
            "max_new_tokens": c.max_new_tokens, "stop_strings": tuple(c.stop_strings),
            "context_limit_policy": c.context_limit_policy, "max_concurrency": c.max_in_flight,
            "retry": c.retry.policy(), "ranks_per_worker": c.ranks_per_worker,
            "sender_spec": c.sender_spec, "control_timeout_s": c.timeouts.refit_s,
        } | overrides
        return build_generation(GenerationConfig(**settings),
                                frontend_url=frontend_url or self.frontend_url,
                                workers=self.endpoints(), control_secret=self.secret,
                                http=http or http_settings(c, settings["max_concurrency"]),
                                lost_workers=self.dead_workers,
                                joined_workers=lambda: self.endpoints(live_only=True))

    def dead_workers(self) -> list[str]:
        """The workers that are gone (one still starting is not among them)."""
        return sorted(name for name, alive in self.placement.alive().items()
                      if not alive and name not in self._starting)

    def lost_workers(self) -> dict[str, str]:
        """Every worker that is gone, with why: its own last word (``engine died: ...``) when
        it left by itself, else that it exited. A worker whose engine dies leaves the
        frontend's routing at once and exits; a driver from ``generation()`` refits without it."""
        logs = {w.name: w.log_path for w in self.workers}
        return {name: exit_reason(logs.get(name, "")) for name in self.dead_workers()}

    @property
    def instance_ids(self) -> dict[str, int]:
        """Worker -> its instance id in Dynamo's discovery (each registered worker)."""
        return dict(self._instances)

    def process_groups(self) -> list[int]:
        """The process group of every worker and of the frontend (each leads its own)."""
        groups = [w.pid for w in self.workers]
        if self.frontend is not None and self.frontend.process is not None:
            groups.append(self.frontend.process.pid)
        return groups

    # -- fault drills --------------------------------------------------------------------------
    def kill_worker(self, name: str) -> None:
        """Kill one worker's process group now."""
        self.placement.kill(name)

    def pause_worker(self, name: str) -> None:
        """SIGSTOP one worker's process group: it keeps its sockets but answers nothing."""
        self.placement.signal(name, signal.SIGSTOP)

    def resume_worker(self, name: str) -> None:
        self.placement.signal(name, signal.SIGCONT)

    def kill_frontend(self) -> None:
        """SIGKILL the frontend's process group (no drain, no goodbye)."""
        process = self.frontend.process if self.frontend is not None else None
        if process is None:
            return
        self.frontend.process = None
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def restart_frontend(self, timeout_s: float = 60.0) -> None:
        """Start the frontend again on its port; wait until it lists the model."""
        if self.frontend.process is None:
            self.frontend.start()
        self.frontend.wait_for_model(self.config.served_model_name, timeout_s=timeout_s)

    # -- stop ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the frontend, the workers and their engines, the placement, etcd. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.config.timeouts.shutdown_s)
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
    attempt may take ``attempt_fixed_s + attempt_per_token_s`` per token of its budget, never
    more than ``request_s``; a read may wait as long)."""
    t = config.timeouts
    return HttpSettings(max_in_flight=max_in_flight, connect_timeout_s=t.connect_s,
                        read_timeout_s=t.request_s, request_timeout_s=t.request_s,
                        attempt_fixed_s=t.attempt_fixed_s, attempt_per_token_s=t.attempt_per_token_s)


def private_folder(path: Path) -> Path:
    """``path`` created if need be, and made the owner's alone (0700): the run folder holds
    the workers' logs and configs and the fleet file."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except PermissionError:
        raise ConfigError(f"run_dir: {str(path)!r} belongs to another user; the fleet makes its "
                          "run folder readable by its owner only") from None
    return path


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to a file only its owner can read (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def worker_name(index: int) -> str:
    return f"worker-{index}"


def worker_failure(log_path: str) -> str:
    """What a worker that failed to start said of it: its exception's own message (the line
    the worker writes last), else the tail of its log."""
    tail = read_tail(log_path, 64_000)
    said = [line.removeprefix(FAILURE_MARK) for line in tail.splitlines()
            if line.startswith(FAILURE_MARK)]
    return said[-1] if said else f"no error reported; its log ends:\n{tail[-3000:]}"


def exit_reason(log_path: str) -> str:
    """One line: what a worker that exited said of it, or that it said nothing (killed)."""
    said = [line.removeprefix(FAILURE_MARK) for line in read_tail(log_path, 64_000).splitlines()
            if line.startswith(FAILURE_MARK)]
    return said[-1] if said else "exited without a word (killed, or its host went away)"


def call_control(control_url: str, name: str, secret: str, body: dict | None = None,
                 timeout_s: float = 30.0) -> dict[str, Any]:
    """A blocking control call (start-up checks, the CLI); the driver uses the http adapter."""
    payload = json.dumps({**(body or {}), "control_secret": secret}).encode()
    request = urllib.request.Request(f"{control_url}/engine/control/{name}", data=payload,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status, data = answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        if refused.code not in (401, 403):
            raise
        status, data = refused.code, _json_or_text(refused.read())
    if status != 200 or not isinstance(data, dict) or data.get("status") != "ok":
        raise ValueError(f"control {name} answered HTTP {status}: {data!r:.300}")
    return data


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace")


def _health_ready(control_url: str) -> bool:
    """Dynamo's own readiness of a worker: its endpoint is registered and serving."""
    try:
        with urllib.request.urlopen(f"{control_url}/health", timeout=2.0) as answer:
            return json.load(answer).get("status") == "ready"
    except (OSError, ValueError, AttributeError):
        return False
