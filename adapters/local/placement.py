"""LocalPlacement: each worker a child process of this one, leading a process group of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from rollout_fleet.adapters.shared import free_port, release_ports, sweep_stale_claims
from rollout_fleet.adapters.shared.processes import (hand_over_secret, interrupts_held,
                                                    secret_stdin, signal_group)
from rollout_fleet.adapters.shared.shm import SegmentWatch
from rollout_fleet.adapters.shared.worker_folders import WorkerFolders
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.ports.placement import (Placement, WorkerHandle, WorkerLaunch,
                                           refuse_live_places, refuse_taken_names)


class LocalPlacement(Placement):
    """Starts every worker on this machine; reserves nothing (the host's cores are shared).

    A worker stays in this process's session, in a process group of its own: Linux's autogroup
    scheduler gives each session its own CPU share, and workers in sessions of their own waited
    for the CPU behind busy-polling neighbours. It is stopped (and signalled) by its group.
    Its control secret goes to its standard input; the /dev/shm segments its processes used
    are removed when it stops or is killed (adapters/shared/shm.py).
    """

    def __init__(self, *, bind_host: str = "127.0.0.1", stop_grace_s: float = 15.0) -> None:
        self._bind_host = bind_host
        self._stop_grace_s = stop_grace_s
        self._processes: dict[str, subprocess.Popen] = {}  # every worker placed, in order
        self._replaced: set[str] = set()  # lost workers a later launch took the place of
        self._ports_given: set[int] = set()
        self._segments = SegmentWatch()
        self._folders = WorkerFolders()

    def launch(self, launches: Sequence[WorkerLaunch]) -> Sequence[WorkerHandle]:
        refuse_taken_names(launches, self._processes)
        refuse_live_places(launches, self.alive(), self._replaced)  # nothing reserved to reuse
        self._replaced.update(launch.in_place_of for launch in launches if launch.in_place_of)
        handles = []
        for launch in launches:
            index = len(self._processes)  # continues after the workers of earlier launches
            # Claimed for this process: not handed out again while the worker comes up.
            ports = {variable: free_port(self._bind_host) for variable in launch.port_env}
            self._ports_given.update(ports.values())
            env = {**os.environ, **launch.env, **{k: str(v) for k, v in ports.items()},
                   **self._folders.make(launch.name, launch.folder_env)}
            if launch.host_env:
                env[launch.host_env] = self._bind_host
            if launch.log_path:
                os.makedirs(os.path.dirname(launch.log_path) or ".", exist_ok=True)
            with interrupts_held(), open(launch.log_path or os.devnull, "ab") as log:
                process = subprocess.Popen(list(launch.argv), env=env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=secret_stdin(launch.secret),
                                           process_group=0)
                self._processes[launch.name] = process
            hand_over_secret(process, launch.secret)
            self._segments.track(launch.name, process.pid)
            handles.append(WorkerHandle(index, launch.name, process.pid, self._bind_host, ports,
                                        launch.log_path))
        return handles

    def alive(self) -> Mapping[str, bool]:
        # A copy: a launch from another thread may add a worker meanwhile.
        return {name: process.poll() is None for name, process in list(self._processes.items())}

    def exit_status(self, name: str) -> int | None:
        return self._process(name).poll()

    def kill(self, name: str) -> None:
        process = self._process(name)
        self._segments.scan(name)  # what it uses now, to remove once it is dead
        signal_group(process.pid, signal.SIGKILL)
        process.wait()
        self._segments.release(name)
        self._folders.remove(name)
        sweep_stale_claims()  # the ports its killed processes had claimed for themselves

    def signal(self, name: str, signum: int) -> None:
        signal_group(self._process(name).pid, signum)

    def stop(self) -> None:
        processes = list(self._processes.values())
        self._segments.scan()
        for process in processes:  # all at once first: each drains in parallel
            for sig in (signal.SIGCONT, signal.SIGTERM):
                signal_group(process.pid, sig)
        deadline = time.monotonic() + self._stop_grace_s
        for process in processes:
            # Waited for, not sent SIGTERM again: a second one a moment after the first at
            # times left Dynamo's drain in a worker hanging until its exit deadline (15 s).
            _wait_then_kill_group(process, max(0.0, deadline - time.monotonic()))
        for name in self._processes:
            self._segments.release(name)
        self._segments.close()
        self._folders.remove_all()
        self._processes.clear()
        release_ports(self._ports_given)  # its workers are gone: nothing will bind them now
        self._ports_given.clear()
        sweep_stale_claims()  # and those a worker killed before its exit claimed itself

    def _process(self, name: str) -> subprocess.Popen:
        try:
            return self._processes[name]
        except KeyError:
            raise RolloutFleetError(f"no worker named {name!r}; workers: {sorted(self._processes)}") from None


def _wait_then_kill_group(process: subprocess.Popen, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for a group leader signalled already, then SIGKILL its group
    (the leader may be gone while others in its group linger)."""
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(process.pid, signal.SIGKILL)
    process.wait()
