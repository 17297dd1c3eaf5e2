"""Helpers shared by the tests above the unit tier: loopback ports, child processes, sockets."""

from tests.support.net import free_port, listening_sockets, non_loopback_listeners
from tests.support.processes import (
    group_members,
    leftover_processes,
    start_child,
    start_worker,
    stop_child,
)

__all__ = [
    "free_port",
    "group_members",
    "leftover_processes",
    "listening_sockets",
    "non_loopback_listeners",
    "start_child",
    "start_worker",
    "stop_child",
]
