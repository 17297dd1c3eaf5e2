"""What the fleet tests share: starting a fleet, and checking that it left nothing behind."""

from __future__ import annotations

import os
import socket

from tests.support.net import listening_sockets
from tests.support.processes import _all_processes, leftover_processes


def own_children_before() -> set[int]:
    return set(_children(os.getpid()))


def _children(parent: int) -> list[int]:
    return [pid for pid, state, ppid, _group in _all_processes() if ppid == parent and state != "Z"]


def assert_nothing_left(fleet_pgids: list[int], ports: list[int], children_before: set[int]) -> None:
    """No process of the fleet (its groups, or new children of this test) and no listener."""
    left = [pid for pid in leftover_processes(fleet_pgids, parent_pid=os.getpid(), wait_s=15)
            if pid not in children_before]
    assert left == [], f"processes left after shutdown: {[_cmdline(p) for p in left]}"
    listening = [port for port in ports if _listening(port)]
    assert listening == [], f"ports still listening after shutdown: {listening}"


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid}: (gone)"


def fleet_ports(fleet) -> list[int]:
    ports = [fleet.frontend.http_port]
    ports += [w.ports["DYN_SYSTEM_PORT"] for w in fleet.workers]
    return ports + ([fleet.door.port] if fleet.door is not None else [])


def non_loopback_fleet_listeners(fleet) -> list:
    """Listeners of the frontend and workers (Dynamo's own servers) and of the door's processes
    that are not on loopback."""
    pids = [fleet.frontend.process.pid] + [w.pid for w in fleet.workers]
    pids += fleet.door.pids if fleet.door is not None else []
    return [s for s in listening_sockets(pids) if not s.is_loopback]
