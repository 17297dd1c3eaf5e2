"""The fleet: N workers started by a placement, one Dynamo frontend owned by the driver,
discovery between them, the door in front of the frontend (the fleet's one URL for clients:
``fleet.door_url``), and a shutdown that leaves nothing behind. The one composition root:
the CLI, the demo, the benches and the tests all start their fleets here.

    fleet = Fleet.start(parse_config({...}))     # or load_config("fleet.toml")
    try:
        generation = fleet.generation()           # FleetGeneration over this fleet
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

import logging
import secrets
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rollout_fleet.adapters.dynamo.etcd import LoopbackEtcd
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend
from rollout_fleet.adapters.http.settings import HttpSettings
from rollout_fleet.adapters.shared import PortsTaken
from rollout_fleet.ports.placement import Placement, PlacementKind, WorkerHandle, WorkerLaunch
from rollout_fleet.wiring.config import FleetConfig
from rollout_fleet.wiring.control_client import call_control
from rollout_fleet.wiring.fleet_discovery import LostWorkerCleanup
from rollout_fleet.wiring.fleet_generation import fleet_generation, http_settings
from rollout_fleet.wiring.fleet_roster import WorkerRoster
from rollout_fleet.wiring.fleet_services import DriverServices
from rollout_fleet.wiring.fleet_watch import WorkerWatcher
from rollout_fleet.wiring.fleet_workers import (SYSTEM_PORT, FleetStartError, collective_backend,
                                                exit_reason, model_folder, private_folder,
                                                wait_worker_ready, worker_config, worker_launch)
from rollout_fleet.wiring.network import check_network
from rollout_fleet.wiring.worker_config import WorkerConfig

if TYPE_CHECKING:
    from rollout_fleet.adapters.nemo_rl import FleetGeneration
    from rollout_fleet.wiring.door import DoorProcesses
    from rollout_fleet.wiring.driver import WorkerEndpoint

# call_control and http_settings are imported from here too (the CLI, tests, benches).
__all__ = ["SYSTEM_PORT", "Fleet", "FleetStartError", "call_control", "http_settings",
           "placement_for"]
logger = logging.getLogger("rollout_fleet.fleet")


def placement_for(config: FleetConfig, groups: Sequence[Any] = ()) -> Placement:
    """The placement the config names; ``groups``: Ray placement groups reserved already, one
    bundle per engine rank, that the workers go into (none of its own is then reserved)."""
    if config.placement is PlacementKind.LOCAL:
        from rollout_fleet.adapters.local import LocalPlacement

        from rollout_fleet.wiring.worker import PRELOAD

        return LocalPlacement(bind_host=config.bind_host, stop_grace_s=config.timeouts.shutdown_s,
                              start=config.worker_start, preload=PRELOAD)
    from rollout_fleet.adapters.ray import RayPlacement

    return RayPlacement(address=config.ray_address, bundle=config.bundle,
                        strategy=config.placement_strategy, bind_host=config.bind_host,
                        bind_per_node=config.spans_nodes, ready_timeout_s=config.timeouts.start_s,
                        groups=groups, bundles_per_worker=config.ranks_per_worker if groups else 1)


def run_folder(run_dir: str | None) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The fleet's run folder, the owner's alone: ``run_dir``, else a temporary one (returned
    too: the fleet removes it at shutdown)."""
    if run_dir:
        return private_folder(Path(run_dir).resolve()), None
    own = tempfile.TemporaryDirectory(prefix="rollout-fleet-")
    return private_folder(Path(own.name).resolve()), own


@attrs.define
class Fleet:
    config: FleetConfig
    placement: Placement
    run_dir: Path
    secret: str = attrs.field(repr=False)
    model_path: str = ""
    _services: DriverServices = attrs.field(init=False, default=attrs.Factory(
        lambda fleet: DriverServices(fleet.config, fleet.run_dir), takes_self=True))
    _stopped: bool = False
    _own_run_dir: tempfile.TemporaryDirectory[str] | None = None
    _roster: WorkerRoster = attrs.field(factory=WorkerRoster)
    _instances: dict[str, int] = attrs.field(factory=dict)  # worker -> its Dynamo instance id
    _stopping: threading.Event = attrs.field(factory=threading.Event)
    _watcher: WorkerWatcher | None = None
    _ports: PortsTaken = attrs.field(factory=PortsTaken)  # claimed here, released at shutdown

    # -- start ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: FleetConfig, placement: Placement | None = None) -> "Fleet":
        """Start everything; on any failure, stop what was started and raise."""
        check_network(config)
        for reminder in config.colocation.reminders(config.device, config.engine):
            logger.warning("%s", reminder)
        run_dir, own = run_folder(config.run_dir)
        fleet = cls(config, placement or placement_for(config), run_dir, secrets.token_hex(16),
                    own_run_dir=own)
        try:
            fleet._start()
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    def _start(self) -> None:
        self.model_path = model_folder(self.config, self.run_dir)
        self._services.start_discovery(self._ports.take)
        self._roster.first(self.placement.launch([self._launch(i)
                                                  for i in range(self.config.num_workers)]))
        self._services.start_frontend(self._ports.take)
        deadline = time.monotonic() + self.config.timeouts.start_s
        for worker in self.workers:
            self._wait_worker_ready(worker, deadline)
        self._services.wait_until_routed(self._instances.values(), deadline)
        self._services.start_door(self.model_path, self.secret)
        cleanup = LostWorkerCleanup(self._instances, kill=self.placement.kill,
                                    forget=self._services.forgetter())
        replace = self.replace_lost_workers if self.config.replace_lost_workers else None
        self._watcher = WorkerWatcher(self.dead_workers, cleanup, replace, self._stopping)
        self._watcher.start()

    def worker_config(self, index: int, *, joins_running: bool = False,
                      slot: int | None = None) -> WorkerConfig:
        """What worker ``index`` is told (``fleet_workers.worker_config``)."""
        return worker_config(self.config, index, run_dir=self.run_dir,
                             model_path=self.model_path, discovery_env=self._services.discovery_env,
                             collective_backend=self.collective_backend,
                             joins_running=joins_running, slot=slot, take_port=self._ports.take)

    def _launch(self, index: int, *, joins_running: bool = False, slot: int | None = None,
                in_place_of: str = "") -> WorkerLaunch:
        config = self.worker_config(index, joins_running=joins_running, slot=slot)
        return worker_launch(self.config, index, config, run_dir=self.run_dir, secret=self.secret,
                             discovery_env=self._services.discovery_env, in_place_of=in_place_of)

    def _wait_worker_ready(self, worker: WorkerHandle, deadline: float) -> None:
        self._instances[worker.name] = wait_worker_ready(
            self.placement, worker, self.control_url(worker), self.secret, deadline=deadline,
            stopping=self._stopping, start_s=self.config.timeouts.start_s)

    # -- joining a running fleet -----------------------------------------------------------------
    def add_worker(self, *, replacing: str | None = None) -> WorkerHandle:
        """Start one more worker (``replacing``: in place of that lost worker, in its
        reservation and on its share of the cores) and wait until it is registered. It serves
        nothing yet: drivers from ``generation()`` take it in when the trainer next asks
        ``get_inference_world_size()``, and it serves once the next update has loaded the
        current weights on it."""
        def launch(index: int, slot: int, in_place_of: str) -> WorkerHandle:
            worker, = self.placement.launch([self._launch(index, joins_running=True, slot=slot,
                                                          in_place_of=in_place_of)])
            return worker

        worker = self._roster.add(replacing, launch=launch, kill=self.placement.kill,
                                  wait_ready=lambda w: self._wait_worker_ready(
                                      w, time.monotonic() + self.config.timeouts.start_s))
        logger.warning("%s joined the fleet%s; it serves after its first refit", worker.name,
                       f" in place of {replacing}" if replacing else "")
        return worker

    def replace_lost_workers(self, lost: list[str] | None = None) -> list[WorkerHandle]:
        """A replacement for every lost worker (``lost``: ``dead_workers()`` when not given)
        that has none yet (see ``add_worker``)."""
        lost = self.dead_workers() if lost is None else lost
        waiting = self._roster.without_replacement(lost)
        return [self.add_worker(replacing=name) for name in waiting]

    # -- running -------------------------------------------------------------------------------
    @property
    def frontend(self) -> DynamoFrontend | None:
        return self._services.frontend

    @property
    def etcd(self) -> LoopbackEtcd | None:
        """The etcd the fleet started itself, if any."""
        return self._services.etcd

    @property
    def frontend_url(self) -> str:
        return self._services.started_frontend().url

    @property
    def door(self) -> "DoorProcesses | None":  # None with [door] processes = 0
        return self._services.door

    @property
    def door_url(self) -> str:
        """The fleet's URL for every client (OpenAI: ``+ "/v1"``); the frontend is internal."""
        return self._services.started_door().url

    @property
    def collective_backend(self) -> str:
        """NCCL between GPUs, gloo between CPUs, or as ``refit.backend`` says."""
        return collective_backend(self.config)

    def control_url(self, worker: WorkerHandle) -> str:
        return f"http://{worker.node_ip}:{worker.ports[SYSTEM_PORT]}"

    @property
    def workers(self) -> list[WorkerHandle]:
        """Every worker started, in order (lost ones too)."""
        return self._roster.workers

    @property
    def control_urls(self) -> dict[str, str]:
        return self._roster.control_urls(self.control_url)

    def worker_control(self, worker: int | str) -> Any:
        """The control of one worker (by index or id), e.g. for a trainer colocated with it:
        ``ColocatedSender(fleet.worker_control(0), ...)`` (``wiring/colocated_trainer.py``)."""
        from rollout_fleet.wiring.colocated_trainer import worker_control

        return worker_control(self, worker)

    def endpoints(self, *, live_only: bool = False) -> list["WorkerEndpoint"]:
        """Every worker's endpoint; ``live_only``: those registered and not lost."""
        from rollout_fleet.wiring.driver import WorkerEndpoint

        left_out = (set(self.dead_workers()) | self._roster.starting) if live_only else set()
        return [WorkerEndpoint(name, url) for name, url in self.control_urls.items()
                if name not in left_out]

    def generation(self, *, frontend_url: str | None = None, http: "HttpSettings | None" = None,
                   **overrides: Any) -> "FleetGeneration":
        """A FleetGeneration over this fleet (``overrides``: GenerationConfig fields;
        ``frontend_url``: e.g. a proxy in front of the frontend); ``shutdown()`` stops the fleet."""
        return fleet_generation(self, frontend_url=frontend_url, http=http, **overrides)

    def dead_workers(self) -> list[str]:
        """The workers that are gone (one still starting is not among them)."""
        return self._roster.dead(self.placement.alive())

    def lost_workers(self) -> dict[str, str]:
        """Every worker that is gone, with why: its own last word (``engine died: ...``) when
        it left by itself, else that it exited. A worker whose engine dies leaves the
        frontend's routing at once and exits; a driver from ``generation()`` refits without it."""
        logs = {w.name: w.log_path for w in self.workers}
        return {name: exit_reason(logs.get(name, ""), self.placement.exit_status(name))
                for name in self.dead_workers()}

    @property
    def instance_ids(self) -> dict[str, int]:
        """Worker -> its instance id in Dynamo's discovery (each registered worker)."""
        return dict(self._instances)

    def process_groups(self) -> list[int]:
        """The process group of each worker, of the frontend, of each door process and of
        the placement's helpers here (a local placement's worker template)."""
        return ([w.pid for w in self.workers] + self.placement.helper_process_groups()
                + self._services.process_groups())

    # -- stop ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the door, frontend, workers (their engines), placement, etcd. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(self.config.timeouts.shutdown_s)
        for stop in (self._services.stop_frontend, self.placement.stop, self._services.stop_etcd):
            try:
                stop()
            except Exception:  # noqa: BLE001 - stop the rest, then report
                logger.exception("fleet shutdown step %s failed", stop.__name__)
        self._ports.release()  # nothing of the fleet binds them any more
        if self._own_run_dir is not None:
            self._own_run_dir.cleanup()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.shutdown()
