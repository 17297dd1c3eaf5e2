"""Claims on the ports ``free_port`` hands out, shared by every process of this user on a host.

A probe finds a port free, but the process that will bind it (a worker being started, Dynamo's
system server inside a worker) may bind it seconds or minutes later; meanwhile another process
of the same fleet probing the same range (the placement choosing the next worker's port, a
worker choosing its inner one, another worker's supervisor on a Ray node) finds it free too.
A claim is a file named after the port, created exclusively; it names its claimer (pid and pid
namespace) and holds the port until the claimer is gone or ``CLAIM_TTL_S`` has passed since,
by when the port's user has long bound it (and then the probe itself refuses it).
"""

from __future__ import annotations

import atexit
import os
import tempfile
import threading
import time
from collections.abc import Iterable

from rollout_fleet.adapters.shared.processes import pid_namespace, process_alive

CLAIM_TTL_S = 900.0  # longer than any worker takes from launch to binding what it was given
CLAIMS_DIR_ENV = "ROLLOUT_FLEET_PORT_CLAIMS"  # where claims live; default: a per-user temp folder


class PortClaims:
    """Exclusive claims in ``folder`` (made 0700, this user's alone). ``claim`` is safe across
    threads and processes; this process's own claims are removed when it exits."""

    def __init__(self, folder: str, ttl_s: float = CLAIM_TTL_S) -> None:
        self.folder, self.ttl_s = folder, ttl_s
        self._mine: dict[str, int] = {}  # claim file -> the pid that made it
        self._lock = threading.Lock()
        self._swept = False

    def claim(self, port: int) -> bool:
        """True when this process now holds ``port``'s claim; False when another live one does."""
        with self._lock:
            if not self._swept:
                self._ensure_folder()
                self.sweep()
                self._swept = True
            path = self._path(port)
            for _ in range(2):  # a stale claim is removed, then claimed again once
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    if not self._stale(path):
                        return False
                    _unlink(path)
                    continue
                with os.fdopen(fd, "w") as claim_file:
                    claim_file.write(_claimer())
                self._mine[path] = os.getpid()
                return True
            return False

    def sweep(self) -> None:
        """Remove stale claims (their claimer gone, or older than the TTL)."""
        for entry in os.scandir(self.folder):
            if entry.name.isdigit() and self._stale(entry.path):
                _unlink(entry.path)

    def sweep_stale(self) -> None:
        """``sweep`` from any thread: after a placement's workers stopped, the claims that a
        worker killed before its exit could release are removed at once, not at the next claim."""
        with self._lock:
            self._ensure_folder()
            self.sweep()

    def release(self, port: int) -> None:
        """Drop this process's claim on ``port`` (its user is gone); another's stays."""
        with self._lock:
            path = self._path(port)
            if self._mine.pop(path, None) == os.getpid():
                _unlink(path)

    def release_mine(self) -> None:
        """At exit: this process's claims go (a forked child's exit leaves its parent's)."""
        with self._lock:
            for path, pid in self._mine.items():
                if pid == os.getpid():
                    _unlink(path)
            self._mine.clear()

    def _stale(self, path: str) -> bool:
        try:
            with open(path) as claim_file:
                claimer = claim_file.read()
            age_s = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            return False  # its claimer released it just now; the next try creates it anew
        pid, _, namespace = claimer.partition(".")
        if age_s > self.ttl_s:
            return True
        # A claim being written (empty yet) or made in another pid namespace waits for the TTL.
        return pid.isdigit() and namespace == pid_namespace() and not process_alive(int(pid))

    def _ensure_folder(self) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        stat = os.lstat(self.folder)
        if stat.st_uid != os.getuid() or stat.st_mode & 0o077 or not os.path.isdir(self.folder) \
                or os.path.islink(self.folder):
            raise OSError(f"port-claims folder {self.folder!r} must be a directory of this user "
                          f"alone (mode 0700); set {CLAIMS_DIR_ENV} to another")

    def _path(self, port: int) -> str:
        return os.path.join(self.folder, str(port))


def _claimer() -> str:
    return f"{os.getpid()}.{pid_namespace()}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def default_claims_dir() -> str:
    return os.environ.get(CLAIMS_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"rollout-fleet-ports-{os.getuid()}")


_claims: PortClaims | None = None
_claims_lock = threading.Lock()


def host_claims() -> PortClaims:
    """This process's view of the host's claims (made on first use, released at exit)."""
    global _claims
    with _claims_lock:
        if _claims is None:
            _claims = PortClaims(default_claims_dir())
            atexit.register(_claims.release_mine)
        return _claims


def release_ports(ports: Iterable[int]) -> None:
    """Release this process's claims on ``ports`` (see ``PortClaims.release``)."""
    for port in ports:
        host_claims().release(port)


def sweep_stale_claims() -> None:
    """Remove this host's claims whose claimers are gone (``PortClaims.sweep_stale``)."""
    host_claims().sweep_stale()
