"""The benches' harness: a bench that starts what binds every interface (a local Ray, Dynamo's
KV-event sockets) runs itself inside a private network namespace, loopback only, so that
nothing it starts is reachable from outside this machine. The product itself never does this:
it runs in its user's own namespace."""

from __future__ import annotations

import os
import shutil
import sys

from rollout_fleet.wiring.network import loopback_only

_MARK = "ROLLOUT_FLEET_BENCH_NETNS"


def reexec_in_private_netns() -> None:
    """Replace this process by itself inside a new network namespace with loopback up (once)."""
    if loopback_only() or os.environ.get(_MARK):
        return
    os.environ[_MARK] = "1"
    unshare = shutil.which("unshare") or "unshare"
    flags = ["-n"] if os.geteuid() == 0 else ["-r", "-n"]  # unprivileged: map ourselves to root
    argv = [unshare, *flags, "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
            sys.executable, *sys.argv]
    os.execvp(argv[0], argv)
