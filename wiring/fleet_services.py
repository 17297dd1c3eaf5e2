"""What a fleet runs on the driver's node beside its workers: the etcd it starts itself (etcd
discovery without an ``etcd_endpoint``) and the Dynamo frontend that routes to the workers.

Each process is recorded before it starts, so that a start interrupted meanwhile stops it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
from rollout_fleet.adapters.dynamo.etcd import LoopbackEtcd
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend
from rollout_fleet.wiring.config import FleetConfig
from rollout_fleet.wiring.fleet_discovery import discovery_env, discovery_forgetter, own_etcd


@attrs.define
class DriverServices:
    config: FleetConfig
    run_dir: Path
    etcd: LoopbackEtcd | None = None
    frontend: DynamoFrontend | None = None
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

    def started_frontend(self) -> DynamoFrontend:
        if self.frontend is None:
            raise RuntimeError("the fleet's frontend is not started")
        return self.frontend

    def forgetter(self) -> Callable[[int], bool]:
        """Ends a lost worker's registration in this discovery."""
        return discovery_forgetter(self.discovery_env, self.run_dir)

    def stop_frontend(self) -> None:
        if self.frontend is not None:
            self.frontend.stop(self.config.timeouts.shutdown_s)

    def stop_etcd(self) -> None:
        """Last: the workers unregister through it while they stop."""
        if self.etcd is not None:
            self.etcd.stop()
