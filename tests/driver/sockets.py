"""Count this process's TCP connections to one port, read from /proc (no sampling of peers)."""

from __future__ import annotations

import os

from tests.support.net import socket_inodes

_ESTABLISHED = "01"


def my_connections_to(port: int) -> int:
    """ESTABLISHED IPv4/IPv6 sockets held by this process whose remote port is ``port``."""
    mine = socket_inodes(os.getpid())
    # Counted by inode: the kernel emits /proc/net/tcp in chunks while the table changes, so
    # one socket can be listed twice in a single read.
    counted = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            remote_port = int(fields[2].split(":")[1], 16)
            if remote_port == port and fields[3] == _ESTABLISHED and fields[9] in mine:
                counted.add(fields[9])
    return len(counted)
