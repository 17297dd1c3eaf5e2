"""The process each Ray actor supervises: a worker started in its own session.

The actor holds the bundle's resources (CPUs, or GPUs: Ray sets CUDA_VISIBLE_DEVICES in the
actor, and the child inherits it); the worker itself is a plain child process, so Dynamo's
runtime owns a real main thread and signals, its log goes to a file, and it is stopped by its
process group. PR_SET_PDEATHSIG kills the child if the actor dies first.

The actor is also the worker's agent on its node: it opens the control secret sealed for it
(adapters/ray/sealed.py) and writes it to the worker's standard input, and it removes the
shared-memory segments the worker's processes leave in /dev/shm (adapters/shared/shm.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from rollout_fleet.adapters.ray.sealed import SecretOpener
from rollout_fleet.adapters.shared import free_port, release_ports, sweep_stale_claims
from rollout_fleet.adapters.shared.processes import hand_over_secret, secret_stdin
from rollout_fleet.adapters.shared.shm import SegmentWatch
from rollout_fleet.adapters.shared.worker_folders import WorkerFolders

_PR_SET_PDEATHSIG = 1


def _new_session_dying_with_parent() -> None:
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ProcessSupervisor:
    """Plain class; RayPlacement wraps it with ray.remote."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._ports: list[int] = []  # claimed here for the worker, released once it is gone
        self._opener = SecretOpener()
        self._segments = SegmentWatch()
        self._folders = WorkerFolders()

    def public_key(self) -> bytes:
        """What the driver seals the control secret for."""
        return self._opener.public_key()

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: str,
              port_env: Sequence[str], bind_host: str | None, sealed_secret: bytes | None = None,
              host_env: str = "", folder_env: str = "") -> dict:
        """Start the worker; ``bind_host=None``: it binds this node's address in the Ray
        cluster (each node's own, found here, on the node), else ``bind_host``."""
        secret = None if sealed_secret is None else self._opener.open(sealed_secret)
        host = bind_host or _node_ip()
        ports = {name: free_port(host) for name in port_env}
        self._ports.extend(ports.values())
        full_env = {**os.environ, **env, **{name: str(port) for name, port in ports.items()},
                    **self._folders.make("worker", folder_env)}
        if host_env:
            full_env[host_env] = host
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen(list(argv), env=full_env, stdout=log,
                                             stderr=subprocess.STDOUT, stdin=secret_stdin(secret),
                                             preexec_fn=_new_session_dying_with_parent)
        hand_over_secret(self._process, secret)
        self._segments.track("worker", self._process.pid)
        return {"pid": self._process.pid, "node_ip": host, "ports": ports, "node_id": _node_id()}

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def exit_status(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def kill(self) -> None:
        self._segments.scan()  # what it uses now, to remove once it is dead
        self._signal(signal.SIGKILL)
        if self._process is not None:
            self._process.wait()
            self._segments.release("worker")
            self._folders.remove("worker")
            self._release_ports()

    def signal(self, signum: int) -> None:
        self._signal(signum)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the worker's process group, SIGKILL it after ``grace_s``; its exit code."""
        if self._process is None:
            return None
        self._segments.scan()
        self._signal(signal.SIGCONT)  # a paused group cannot act on SIGTERM
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        code = self._process.wait()
        self._segments.release("worker")
        self._segments.close()
        self._folders.remove_all()
        self._release_ports()
        return code

    def _release_ports(self) -> None:
        """The worker is gone: its port and what its own killed processes claimed go too."""
        release_ports(self._ports)
        self._ports.clear()
        sweep_stale_claims()

    def _signal(self, sig: int) -> None:
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, sig)  # the worker and anything it started
        except ProcessLookupError:
            pass


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests of the supervisor itself)
        return "127.0.0.1"


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray
        return ""
