"""What a fleet runs on the driver's node beside its workers: the etcd it starts itself (etcd
discovery without an ``etcd_endpoint``), the Dynamo frontend that routes to the workers (the
driver's rollouts go there), and the door in front of it (``wiring/door.py``: the fleet's one
URL for every other client; none with ``[door] processes = 0``).

Each process is recorded before it starts, so that a start interrupted meanwhile stops it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs
from rollout_fleet.adapters.dynamo.etcd import LoopbackEtcd
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend
from rollout_fleet.wiring.config import FleetConfig
from rollout_fleet.wiring.fleet_discovery import discovery_env, discovery_forgetter, own_etcd

if TYPE_CHECKING:
    from rollout_fleet.wiring.door import DoorProcesses, DoorSettings


Started = TypeVar("Started")


@attrs.define
class DriverServices:
    config: FleetConfig
    run_dir: Path
    etcd: LoopbackEtcd | None = None
    frontend: DynamoFrontend | None = None
    door: "DoorProcesses | None" = None
    # What the frontend and every worker are told of the discovery (set by start_discovery).
    discovery_env: dict[str, str] = attrs.field(factory=dict)

    def start_discovery(self, take_port: Callable[[str], int]) -> None:
        """The fleet's own etcd when it needs one; file discovery needs nothing started."""
        self.etcd = own_etcd(self.config, self.run_dir, take_port=take_port)
        if self.etcd is not None:
            self.etcd.start()
        self.discovery_env = discovery_env(self.config, self.etcd)

    def start_frontend(self, take_port: Callable[[str], int]) -> None:
        port = self.config.frontend_port or take_port(self.config.bind_host)
        env = {"DYN_ROUTER_MODE": self.config.router, **self.discovery_env, **self.config.env}
        self.frontend = DynamoFrontend(self.run_dir, http_port=port, extra_env=env,
                                       host=self.config.bind_host)
        self.frontend.start()

    def wait_until_routed(self, instances: Iterable[int], deadline: float) -> None:
        """Until the frontend lists the served model and knows every worker's instance."""
        frontend = self.started_frontend()
        frontend.wait_for_model(self.config.served_model_name,
                                timeout_s=max(1.0, deadline - time.monotonic()))
        frontend.wait_for_instances(instances, timeout_s=max(1.0, deadline - time.monotonic()))

    def start_door(self, model_path: str, secret: str) -> None:
        """The door's processes in front of the started frontend, taking the fleet's control
        secret; none with ``[door] processes = 0``. Recorded before it starts: a start that
        fails or is interrupted stops what it started, and the fleet's shutdown the rest."""
        if not self.config.door.processes:
            return
        from rollout_fleet.wiring.door import door_processes

        config = self.config
        self.door = door_processes(
            self.started_frontend().url, model_path, config.served_model_name, config.chat,
            max_model_len=config.max_model_len, host=config.bind_host, port=config.door.port,
            run_dir=self.run_dir, settings=self.door_settings(), control_secret=secret)
        self.door.start()

    def door_settings(self) -> "DoorSettings":
        """The ``[door]`` section, with the fleet's own deadlines and retries for its hop."""
        from rollout_fleet.wiring.door import DoorSettings

        config = self.config
        return DoorSettings(
            processes=config.door.processes, connect_s=config.timeouts.connect_s,
            read_s=config.timeouts.request_s, retry=config.retry.policy(),
            trajectories=config.door.trajectories, idle_s=config.door.idle_s,
            render_threads=config.door.render_threads, start_s=config.timeouts.start_s,
            stop_s=config.timeouts.shutdown_s)

    def started_door(self) -> "DoorProcesses":
        return _started(self.door, "this fleet has no door ([door] processes = 0)")

    def started_frontend(self) -> DynamoFrontend:
        return _started(self.frontend, "the fleet's frontend is not started")

    def process_groups(self) -> list[int]:
        """The frontend's process group and each door process's (each leads its own)."""
        groups = list(self.door.process_groups) if self.door is not None else []
        if self.frontend is not None and self.frontend.process is not None:
            groups.append(self.frontend.process.pid)
        return groups

    def forgetter(self) -> Callable[[int], bool]:
        """Ends a lost worker's registration in this discovery."""
        return discovery_forgetter(self.discovery_env, self.run_dir)

    def stop_frontend(self) -> None:
        """The door in front of it first: nothing reaches the frontend from outside while the
        fleet stops."""
        try:
            if self.door is not None:
                self.door.stop()
        finally:
            if self.frontend is not None:
                self.frontend.stop(self.config.timeouts.shutdown_s)

    def stop_etcd(self) -> None:
        """Last: the workers unregister through it while they stop."""
        if self.etcd is not None:
            self.etcd.stop()


def _started(part: Started | None, missing: str) -> Started:
    if part is None:
        raise RuntimeError(missing)
    return part
