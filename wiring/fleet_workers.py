"""What each worker of a fleet is told and how it is launched: its config file (written once,
the owner's alone), its command line and environment, and what a worker that stopped said."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rollout_fleet.adapters.dynamo.env import dynamo_env
from rollout_fleet.adapters.shared import free_port, read_tail
from rollout_fleet.core.device import Device
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.ports.placement import Placement, WorkerHandle, WorkerLaunch
from rollout_fleet.wiring.config import ConfigError, FleetConfig, fleet_facts
from rollout_fleet.wiring.control_client import call_control, health_ready
from rollout_fleet.wiring.fleet_roster import worker_name
from rollout_fleet.wiring.worker import BIND_HOST_ENV, FAILURE_MARK, FOLDER_ENV
from rollout_fleet.wiring.worker_config import WorkerConfig

SYSTEM_PORT = "DYN_SYSTEM_PORT"  # each worker's system server: health, controls, metrics


class FleetStartError(RolloutFleetError):
    """The fleet did not come up; names the worker, its own error and its log."""


def model_folder(config: FleetConfig, run_dir: Path) -> str:
    """The model every worker serves: the config's folder, or (``model = "tiny"``) the folder
    its engine kind writes, else the tiny model built once into the run folder."""
    if config.model != "tiny":
        return str(Path(config.model).resolve())
    own = config.engine_choice.model_folder(run_dir)
    if own is not None:
        return own
    from rollout_fleet.adapters.tiny_model import tiny_model_folder

    return tiny_model_folder(run_dir / "tiny-model")


def collective_backend(config: FleetConfig) -> str:
    """What the refit group runs on: NCCL between GPUs, gloo between CPUs (or as
    ``refit.backend`` says)."""
    if config.refit.backend != "auto":
        return config.refit.backend
    return "nccl" if config.device is Device.GPU else "gloo"


def worker_config(config: FleetConfig, index: int, *, run_dir: Path, model_path: str,
                  discovery_env: Mapping[str, str], collective_backend: str,
                  joins_running: bool = False, slot: int | None = None,
                  take_port: Callable[[str], int] = free_port) -> WorkerConfig:
    """What worker ``index`` is told (python -m rollout_fleet.wiring.worker --config).
    ``joins_running``: it joins a fleet that may have been refit, so it serves only after its
    first refit. ``slot``: whose share of this host's cores it takes (a replacement takes the
    lost worker's). ``take_port``: where the ports its table names come from."""
    slot = (index if slot is None else slot) % config.num_workers
    engine = config.engine_choice.worker_table(fleet_facts(config), slot=slot,
                                               free_port=lambda: take_port(config.bind_host))
    kv_routing = config.router == "kv"
    return WorkerConfig(
        engine=engine, run_dir=str(run_dir), kv_routing=kv_routing,
        collective_backend=collective_backend,
        namespace="fleet", served_model_name=config.served_model_name,
        model_path=model_path or None, env={**discovery_env, **config.env},
        hold_until_refit=joins_running, hang_timeout_s=config.hang_timeout_s,
        worker_id=worker_name(index), chat=dict(config.chat))


def worker_launch(config: FleetConfig, index: int, worker_config: WorkerConfig, *,
                  run_dir: Path, secret: str, discovery_env: Mapping[str, str],
                  in_place_of: str = "") -> WorkerLaunch:
    """Worker ``index``'s launch: its config written to the run folder, its command line, its
    environment; the placement hands it the control secret on its standard input."""
    name = worker_name(index)
    config_path = write_private(run_dir / f"{name}.json", worker_config.to_json())
    env = {**dynamo_env(run_dir), **discovery_env, **config.env, "PYTHONUNBUFFERED": "1"}
    return WorkerLaunch(name=name, argv=(sys.executable, "-m", "rollout_fleet.wiring.worker",
                                         "--config", str(config_path), "--control-secret-stdin"),
                        env=env, log_path=str(run_dir / f"{name}.log"),
                        port_env=(SYSTEM_PORT,), secret=secret, host_env=BIND_HOST_ENV,
                        in_place_of=in_place_of, folder_env=FOLDER_ENV)


def wait_worker_ready(placement: Placement, worker: WorkerHandle, url: str, secret: str, *,
                      deadline: float, stopping: threading.Event, start_s: float) -> int:
    """Wait until ``worker`` (its controls at ``url``) is ready; its Dynamo instance id.
    FleetStartError when it exits, is not ready by ``deadline`` or the fleet stops first."""
    while time.monotonic() < deadline and not stopping.is_set():
        if not placement.alive().get(worker.name, False):
            how = worker_failure(worker.log_path, placement.exit_status(worker.name))
            raise FleetStartError(f"{worker.name} exited while starting: {how} "
                                  f"(log {worker.log_path})")
        if health_ready(url):
            return call_control(url, "stats", secret)["instance_id"]
        time.sleep(0.25)
    raise FleetStartError(f"{worker.name} was not ready at {url} within "
                          f"{start_s:.0f} s (log {worker.log_path}):\n"
                          f"{read_tail(worker.log_path)}")


def private_folder(path: Path) -> Path:
    """``path`` created if need be, and made the owner's alone (0700): the run folder holds
    the workers' logs and configs and the fleet file."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except PermissionError:
        raise ConfigError(f"run_dir: {str(path)!r} belongs to another user; the fleet makes its "
                          "run folder readable by its owner only") from None
    return path


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to a file only its owner can read (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def worker_failure(log_path: str, exit_status: int | None = None) -> str:
    """What a worker that failed to start said of it: its exception's own message (the line
    the worker writes last), else how it ended (``exit_status``, as the placement saw it) and
    the tail of its log; and the error that one of its engine's own processes logged before,
    which the worker's message only points at (vLLM's "Engine core initialization failed. See
    root cause above")."""
    tail = read_tail(log_path, 64_000)
    said = [line.removeprefix(FAILURE_MARK) for line in tail.splitlines()
            if line.startswith(FAILURE_MARK)]
    cause = engine_process_error(tail)
    if said:
        return f"{said[-1]}; {cause}" if cause else said[-1]
    silent = silent_exit(exit_status)
    return f"{silent}; {cause}" if cause else f"{silent}; its log ends:\n{tail[-3000:]}"


def silent_exit(exit_status: int | None) -> str:
    """How a worker that reported no error ended, in words."""
    if exit_status is None:
        return "no error reported"
    if exit_status >= 0:
        return f"exited with status {exit_status}, no error reported"
    try:
        name = signal.Signals(-exit_status).name
    except ValueError:
        name = f"signal {-exit_status}"
    if -exit_status == signal.SIGKILL:
        name += " (the kernel's out-of-memory killer sends it, as does kill -9)"
    return f"killed by {name}, no error reported"


# vLLM prefixes what its own processes log with their name and pid; an error's last line is
# the exception's type and message.
_ENGINE_PROCESS_ERROR = re.compile(r"^\((?P<process>\w+) pid=\d+\) ERROR [^\]]*\] "
                                   r"(?P<error>[A-Za-z_][\w.]*(Error|Exception): .*)$")


def engine_process_error(log: str) -> str:
    """The last error that a process of the worker's engine (not the worker's own, vLLM's
    ``MainProcess``) logged, as ``<process> logged <type>: <message>``; empty when none."""
    for line in reversed(log.splitlines()):
        found = _ENGINE_PROCESS_ERROR.match(line.strip())
        if found and found["process"] != "MainProcess":
            return f"its {found['process']} logged {found['error']}"
    return ""


def exit_reason(log_path: str, exit_status: int | None = None) -> str:
    """One line: what a worker that exited said of it, or how it ended without a word."""
    said = [line.removeprefix(FAILURE_MARK) for line in read_tail(log_path, 64_000).splitlines()
            if line.startswith(FAILURE_MARK)]
    if said:
        return said[-1]
    if exit_status is None:
        return "exited without a word (killed, or its host went away)"
    return silent_exit(exit_status)
