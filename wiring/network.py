"""What the fleet binds, and the one warning about what it cannot keep on ``bind_host``.

Everything the project starts itself (the frontend, etcd, each worker's system and request
ports, the trainer's end of the refit group) listens on ``bind_host`` (loopback by default).
Two dependencies bind every interface whatever they are told: a local Ray's daemons, and
Dynamo's KV-event sockets (``router = "kv"``). The fleet runs in its user's own network
namespace all the same; it says so once at start, and relies on what those dependencies offer
(Ray's token authentication, on by default for a local cluster).
"""

from __future__ import annotations

import logging
import os
import socket

from rollout_fleet.ports.placement import PlacementKind
from rollout_fleet.wiring.config import ConfigError, FleetConfig, port_in_use

logger = logging.getLogger("rollout_fleet.fleet")


def loopback_only() -> bool:
    """True when loopback is the only network interface this process can see (then nothing
    that binds every interface is reachable from another machine)."""
    # /sys/class/net shows the host's interfaces until sysfs is remounted; ask the kernel instead.
    try:
        return {name for _index, name in socket.if_nameindex()} == {"lo"}
    except OSError:
        return False


def wide_binds(config: FleetConfig) -> list[str]:
    """What this fleet starts that listens on every interface, each with what guards it."""
    found = []
    if config.placement is PlacementKind.RAY and config.ray_address is None:
        auth = os.environ.get("RAY_AUTH_MODE", "token").lower()
        guard = ("Ray's token authentication guards them" if auth == "token" else
                 f"RAY_AUTH_MODE={auth}: Ray's token authentication is OFF, anyone who reaches "
                 "this machine can run code in the cluster")
        found.append(f"the local Ray cluster's daemons listen on every interface ({guard})")
    if config.router == "kv":
        found.append("Dynamo's KV-event sockets (router = \"kv\") bind every interface "
                     "(0.0.0.0, fixed in Dynamo)")
    return found


def check_network(config: FleetConfig) -> None:
    """Refuse a ``bind_host`` that is not this machine's; warn once about wide binds."""
    if port_in_use(config.bind_host, 0):
        raise ConfigError(f"bind_host={config.bind_host!r} is not an address of this machine "
                          "(nothing can listen there): give the driver node's own address")
    if loopback_only():
        return
    for line in wide_binds(config):
        logger.warning("%s; everything else listens on %s only", line, config.bind_host)
