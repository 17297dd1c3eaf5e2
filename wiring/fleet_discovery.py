"""The fleet's side of Dynamo's discovery: the etcd it starts itself when asked, what its
frontend and workers are told of it, and the cleanup of each lost worker (its registration
ended at once, what is left of its processes killed)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
from rollout_fleet.adapters.dynamo.etcd import LoopbackEtcd
from rollout_fleet.adapters.shared import free_port
from rollout_fleet.wiring.config import FleetConfig

logger = logging.getLogger("rollout_fleet.fleet")


def own_etcd(config: FleetConfig, run_dir: Path,
             take_port: Callable[[str], int] = free_port) -> LoopbackEtcd | None:
    """The etcd the fleet starts itself (etcd discovery without an ``etcd_endpoint``), not
    started yet; None when it needs none. ``take_port``: where its two ports come from."""
    if config.discovery == "file" or config.etcd_endpoint is not None:
        return None
    host = config.bind_host
    return LoopbackEtcd(run_dir / "etcd" / "data", host=host,
                        client_port=take_port(host), peer_port=take_port(host))


def discovery_env(config: FleetConfig, etcd: LoopbackEtcd | None) -> dict[str, str]:
    """What the frontend and every worker are told of the discovery (nothing: file discovery
    in the run folder)."""
    if config.discovery == "file":
        return {}
    endpoint = config.etcd_endpoint if etcd is None else etcd.endpoint
    if endpoint is None:
        raise ValueError("etcd discovery without an etcd_endpoint needs the fleet's own etcd "
                         "(own_etcd)")
    return {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": endpoint}


def discovery_forgetter(discovery_env: Mapping[str, str],
                        run_dir: Path) -> Callable[[int], bool]:
    """Ends a Dynamo instance's registration in the fleet's discovery: etcd's lease when the
    fleet runs on etcd, else the files in its discovery folder."""
    from rollout_fleet.adapters.dynamo.discovery import forget_instance

    etcd = discovery_env.get("ETCD_ENDPOINTS", "").split(",")[0] or None
    file_kv = None if etcd else run_dir / "discovery"
    return lambda instance_id: forget_instance(instance_id, etcd_endpoint=etcd, file_kv=file_kv)


@attrs.define
class LostWorkerCleanup:
    """Each lost worker once: out of discovery (the frontend drops it at once, not when its
    registration expires) and its process group killed (a worker that left because its engine
    hung may leave that engine's process behind, stopped or deaf to SIGTERM, holding its
    memory and devices, which a replacement needs)."""

    instances: Mapping[str, int]  # worker -> its Dynamo instance id (each registered worker)
    forget: Callable[[int], bool]  # ends an instance's registration; True when it removed one
    kill: Callable[[str], None]  # SIGKILLs a worker's process group
    _forgotten: set[str] = attrs.field(factory=set)
    _killed: set[str] = attrs.field(factory=set)

    def forget_in_discovery(self, lost: list[str]) -> None:
        for name in lost:
            if name in self._forgotten or name not in self.instances:
                continue
            self._forgotten.add(name)
            if self.forget(self.instances[name]):
                logger.warning("%s is lost: taken out of discovery", name)

    def kill_what_is_left_of(self, lost: list[str]) -> None:
        for name in lost:
            if name in self._killed:
                continue
            self._killed.add(name)
            try:
                self.kill(name)
            except Exception as exc:  # noqa: BLE001 - its node may be gone with it
                logger.info("%s: nothing of it could be killed (%s: %s)", name,
                            type(exc).__name__, exc)
