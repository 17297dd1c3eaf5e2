"""Free ports on this host, in the range every fleet server accepts; loopback addresses; the
sockets a process holds (read from /proc)."""

from __future__ import annotations

import ipaddress
import random
import socket

from rollout_fleet.adapters.shared.port_claims import PortClaims, host_claims
from rollout_fleet.adapters.shared.processes import open_file_links

# Dynamo 1.6.1 parses DYN_SYSTEM_PORT as a signed 16-bit int: ports above 32767 are refused.
# Kernel-chosen ports (bind to 0) come from the ephemeral range (32768+), so pick below it:
# then no client socket can take a port while its server restarts.
PORT_RANGE = (20000, 32767)


def free_port(host: str = "127.0.0.1", port_range: tuple[int, int] = PORT_RANGE,
              claims: PortClaims | None = None) -> int:
    """A port in ``port_range`` that nothing listens on now and no other live process of this
    user was handed by this function (random probes; ``claims``: the host's by default). The
    claim keeps it from everyone else until this process exits."""
    low, high = port_range
    claims = claims or host_claims()
    for _ in range(200):
        port = random.randint(low, high)
        if _bindable(host, port) and claims.claim(port):
            return port
    raise OSError(f"no free port in {low}-{high} on {host}")


class PortsTaken:
    """The ports one owner (a fleet: its frontend, its etcd, its workers' tables) took with
    ``free_port``, released together once everything that would bind them has stopped: an
    owner that failed to start and lives on (a trainer retrying) leaves no claims behind."""

    def __init__(self) -> None:
        self._ports: set[int] = set()

    def take(self, host: str = "127.0.0.1") -> int:
        port = free_port(host)
        self._ports.add(port)
        return port

    def release(self) -> None:
        ports, self._ports = self._ports, set()
        for port in ports:
            host_claims().release(port)


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def socket_inodes(pid: int) -> set[str]:
    """The inodes of every socket that process ``pid`` holds open (empty when it is gone)."""
    return {target[len("socket:["):-1] for _fd, target in open_file_links(pid)
            if target.startswith("socket:[")}
