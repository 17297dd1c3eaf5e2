"""LocalPlacement: each worker a process of this machine, leading a process group of its own:
a child of this process, or forked from a template process that has imported what it imports."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from rollout_fleet.adapters.local.forked import ForkTemplate, forkable, launch_env
from rollout_fleet.adapters.shared import free_port, release_ports, sweep_stale_claims
from rollout_fleet.adapters.shared.processes import (hand_over_secret, interrupts_held,
                                                    secret_stdin, signal_group)
from rollout_fleet.adapters.shared.shm import SegmentWatch
from rollout_fleet.adapters.shared.worker_folders import WorkerFolders
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.ports.placement import (Placement, WorkerHandle, WorkerLaunch,
                                           refuse_live_places, refuse_taken_names)

logger = logging.getLogger("rollout_fleet.placement")
WorkerStart = Literal["exec", "fork"]


class WorkerProcess(Protocol):
    """What the placement reads of a worker's process: ``subprocess.Popen`` or a forked one."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class LocalPlacement(Placement):
    """Starts every worker on this machine; reserves nothing (the host's cores are shared).

    A worker stays in this process's session, in a process group of its own: Linux's autogroup
    scheduler gives each session its own CPU share, and workers in sessions of their own waited
    for the CPU behind busy-polling neighbours. It is stopped (and signalled) by its group.
    Its control secret goes to its standard input; the /dev/shm segments its processes used
    are removed when it stops or is killed (adapters/shared/shm.py).

    ``start="fork"``: a worker whose command is ``python -m module ...`` (or ``-c code``) with
    this interpreter is forked from a template process that imported ``preload`` once
    (adapters/local/fork_template.py), so N workers starting at once do not each pay for those
    imports; any other command is started as a new process (``start="exec"`` starts every
    worker so). The template imports under the first launch's environment less each worker's
    own variables (ports, host, folder): the modules in ``preload`` must not read at import
    what differs between workers.
    """

    def __init__(self, *, bind_host: str = "127.0.0.1", stop_grace_s: float = 15.0,
                 start: WorkerStart = "exec", preload: Sequence[str] = ()) -> None:
        self._bind_host = bind_host
        self._stop_grace_s = stop_grace_s
        self._start = start
        self._preload = tuple(preload)
        self._template: ForkTemplate | None = None
        self._processes: dict[str, WorkerProcess] = {}  # every worker placed, in order
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
            process = self._start_process(launch, env)
            self._segments.track(launch.name, process.pid)
            handles.append(WorkerHandle(index, launch.name, process.pid, self._bind_host, ports,
                                        launch.log_path))
        return handles

    def _start_process(self, launch: WorkerLaunch, env: Mapping[str, str]) -> WorkerProcess:
        template = self._template_for(launch, env)
        if template is not None:
            with interrupts_held():
                process = template.start(launch.argv, env, launch.log_path, launch.secret)
                self._processes[launch.name] = process
            return process
        with interrupts_held(), open(launch.log_path or os.devnull, "ab") as log:
            child = subprocess.Popen(list(launch.argv), env=env, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=secret_stdin(launch.secret),
                                     process_group=0)
            self._processes[launch.name] = child
        hand_over_secret(child, launch.secret)
        return child

    def _template_for(self, launch: WorkerLaunch, env: Mapping[str, str]) -> ForkTemplate | None:
        """The worker template this launch is forked from (started on first use); None: the
        launch starts as a new process (``start="exec"``, not a ``python -m``/``-c`` command,
        or no template that can fork, which is logged)."""
        if self._start != "fork" or not forkable(launch.argv):
            return None
        if self._template is None:
            try:
                self._template = ForkTemplate(self._preload, launch_env(env, _own_keys(launch)),
                                              _template_log(launch.log_path))
            except RolloutFleetError as exc:
                logger.warning("local placement: starting workers as new processes: %s", exc)
                self._start = "exec"
                return None
        return None if self._template.gone else self._template

    def alive(self) -> Mapping[str, bool]:
        # A copy: a launch from another thread may add a worker meanwhile.
        return {name: process.poll() is None for name, process in list(self._processes.items())}

    def helper_process_groups(self) -> list[int]:
        return [] if self._template is None else [self._template.pid]

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
        if self._template is not None:
            self._template.close()
            self._template = None
        self._folders.remove_all()
        self._processes.clear()
        release_ports(self._ports_given)  # its workers are gone: nothing will bind them now
        self._ports_given.clear()
        sweep_stale_claims()  # and those a worker killed before its exit claimed itself

    def _process(self, name: str) -> WorkerProcess:
        try:
            return self._processes[name]
        except KeyError:
            raise RolloutFleetError(f"no worker named {name!r}; workers: {sorted(self._processes)}") from None


def _own_keys(launch: WorkerLaunch) -> tuple[str, ...]:
    """The environment variables each worker of a launch gets a value of its own in."""
    return tuple(key for key in (*launch.port_env, launch.host_env, launch.folder_env) if key)


def _template_log(worker_log: str) -> str:
    """The template's log: beside the first forked worker's."""
    return os.path.join(os.path.dirname(worker_log), "worker-template.log") if worker_log else ""


def _wait_then_kill_group(process: WorkerProcess, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for a group leader signalled already, then SIGKILL its group
    (the leader may be gone while others in its group linger)."""
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(process.pid, signal.SIGKILL)
    process.wait()
