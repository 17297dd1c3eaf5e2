"""Private network namespaces: where servers that insist on binding every interface may run.

Ray's daemons and Dynamo's KV-event sockets bind 0.0.0.0. Inside ``unshare -n`` the only
interface is loopback, so those binds reach nothing outside the machine's own namespace.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Sequence

MARK = "ROLLOUT_FLEET_NETNS"


def in_private_netns() -> bool:
    """True when loopback is the only network interface this process can see."""
    # /sys/class/net shows the host's interfaces until sysfs is remounted; ask the kernel instead.
    try:
        return {name for _index, name in socket.if_nameindex()} == {"lo"}
    except OSError:
        return False


def netns_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped to run in a new network namespace with loopback up."""
    unshare = shutil.which("unshare") or "unshare"
    flags = ["-n"] if os.geteuid() == 0 else ["-r", "-n"]  # unprivileged: map ourselves to root
    return [unshare, *flags, "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def reexec_in_private_netns() -> None:
    """Replace this process by itself inside a private network namespace (once)."""
    if in_private_netns() or os.environ.get(MARK):
        return
    os.environ[MARK] = "1"
    argv = netns_argv([sys.executable, *sys.argv])
    os.execvp(argv[0], argv)
