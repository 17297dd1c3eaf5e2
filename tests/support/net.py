"""Loopback ports, and which sockets a set of processes listens on or holds (read from /proc)."""

from __future__ import annotations

import socket
from collections.abc import Iterable

import attrs
from rollout_fleet.adapters.shared.net import free_port as shared_free_port
from rollout_fleet.adapters.shared.net import socket_inodes

_TCP_LISTEN = "0A"


def free_port() -> int:
    """A TCP port free on 127.0.0.1, claimed for this run (the project's own pick, in
    20000-32767: below the kernel's ephemeral range, so no client socket takes it before its
    server binds it, and within the signed 16-bit range Dynamo's system port needs)."""
    return shared_free_port("127.0.0.1")


@attrs.frozen
class Listener:
    pid: int
    address: str  # "127.0.0.1", "0.0.0.0", "::1", "::"...
    port: int

    @property
    def is_loopback(self) -> bool:
        return self.address in ("127.0.0.1", "::1", "::ffff:127.0.0.1") \
            or self.address.startswith("127.")


def listening_sockets(pids: Iterable[int]) -> list[Listener]:
    """Every TCP socket in LISTEN state that one of ``pids`` holds (IPv4 and IPv6)."""
    inode_to_pid = {}
    for pid in pids:
        for inode in socket_inodes(pid):
            inode_to_pid[inode] = pid
    listeners = []
    for table, parse in (("/proc/net/tcp", _ipv4), ("/proc/net/tcp6", _ipv6)):
        for local, state, inode in _rows(table):
            if state == _TCP_LISTEN and inode in inode_to_pid:
                hex_address, hex_port = local.split(":")
                listeners.append(Listener(inode_to_pid[inode], parse(hex_address), int(hex_port, 16)))
    return listeners


def unix_socket_files(pids: Iterable[int]) -> set[str]:
    """The files of the Unix sockets that one of ``pids`` holds (abstract sockets, which have
    no file, left out): ZMQ's ``ipc://`` endpoints among them."""
    inodes = {inode for pid in pids for inode in socket_inodes(pid)}
    try:
        with open("/proc/net/unix") as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return set()
    # Num RefCount Protocol Flags Type St Inode [Path]
    return {row[7] for row in rows if len(row) > 7 and row[6] in inodes and row[7].startswith("/")}


def non_loopback_listeners(pids: Iterable[int]) -> list[Listener]:
    return [s for s in listening_sockets(pids) if not s.is_loopback]


def _rows(table: str):
    try:
        with open(table) as f:
            lines = f.readlines()[1:]
    except OSError:
        return
    for line in lines:
        fields = line.split()
        yield fields[1], fields[3], fields[9]


def _ipv4(hex_address: str) -> str:
    return socket.inet_ntop(socket.AF_INET, bytes.fromhex(hex_address)[::-1])


def _ipv6(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc prints the address as four little-endian 32-bit words
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def in_private_netns() -> bool:
    """True when loopback is the only interface here: the harness's guard for tests that start
    what binds every interface (a local Ray, Dynamo's KV-event sockets)."""
    from rollout_fleet.wiring.network import loopback_only

    return loopback_only()
