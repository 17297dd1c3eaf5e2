"""Each pytest-xdist worker in a network namespace of its own, with a Ray temp folder of its own,
so that tests starting Ray clusters and Dynamo frontends run on both workers at once: two Ray
clusters in one namespace would share its ports, and a ``ray.init()`` with no address joins the
cluster that the folder's ``ray_current_cluster`` names, whichever worker started it.

The namespace is taken by the worker's main thread before any test runs; every process a test
starts inherits it, and ``/proc/net`` (read by the tests' socket checks) shows it. Taking it
needs what ``unshare -n`` needs (root, or a user namespace of one's own): scripts/test.sh runs
the suite so; elsewhere a worker that cannot take it stops the run saying why."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

import pytest

_CLONE_NEWNET = 0x40000000  # <sched.h>


def take_own_network(worker: str) -> str:
    """Unshare this thread's network namespace, bring its loopback up and point Ray at a temp
    folder of this worker's; returns that folder (removed by ``release``)."""
    try:
        _unshare_network()
    except OSError as error:
        raise pytest.UsageError(
            f"pytest-xdist worker {worker} could not take a network namespace of its own "
            f"({error}): run the suite through scripts/test.sh (inside `unshare -n`), or with "
            f"-n 0") from error
    up = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if up.returncode != 0:
        raise pytest.UsageError(f"worker {worker}: `ip link set lo up` failed: {up.stderr}")
    ray_folder = tempfile.mkdtemp(prefix=f"rollout-fleet-ray-{worker}-")
    os.environ["RAY_TMPDIR"] = ray_folder
    return ray_folder


def _unshare_network() -> None:
    """unshare(2) for the calling thread (os.unshare is Python 3.12's; the suite runs on 3.11)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def release(ray_folder: str) -> None:
    shutil.rmtree(ray_folder, ignore_errors=True)
