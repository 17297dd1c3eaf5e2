"""The fleet file: how other commands find (and reach) a fleet that ``rollout-fleet serve`` runs.

The fleet runs in its user's own network namespace, so any shell of the same user on the
driver's machine reaches the URLs the file lists. The file names the ``serve`` process too, so
a command given a stale file says that the fleet is gone instead of timing out. It holds the
control secret, so it is written with mode 0600.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs

from rollout_fleet.core.errors import InvalidValue, RolloutFleetError

_FLAG = "--fleet-file"


@attrs.frozen
class FleetFile:
    frontend_url: str  # the driver's rollouts (generate, refit); internal to the fleet
    control_urls: dict[str, str]
    secret: str = attrs.field(repr=False)
    serve_pid: int  # the `serve` process that owns the fleet
    served_model_name: str = "tiny"
    max_model_len: int = 512
    max_new_tokens: int = 64
    buffer_bytes: int = 1 << 30
    num_buffers: int = 2
    refit_fanout: str = "broadcast"
    ranks_per_worker: int = 1
    device: str = "cpu"
    # What the workers' receivers use (NCCL on GPU fleets); the trainer side must match it.
    collective_backend: str = "gloo"
    # name -> pid of each process group the fleet runs here: frontend, workers, door-<i>
    processes: dict[str, int] = attrs.field(factory=dict)
    door_url: str = ""  # the fleet's URL for every other client ("": no door)

    @classmethod
    def of_fleet(cls, fleet: Any) -> "FleetFile":
        config = fleet.config
        live = {e.worker_id: e.system_url for e in fleet.endpoints(live_only=True)}
        processes = {w.name: w.pid for w in fleet.workers if w.name in live}
        if fleet.frontend is not None and fleet.frontend.process is not None:
            processes["frontend"] = fleet.frontend.process.pid
        door = fleet.door
        processes.update({f"door-{i}": pid for i, pid in enumerate(door.pids if door else [])})
        return cls(frontend_url=fleet.frontend_url, control_urls=live,
                   secret=fleet.secret, serve_pid=os.getpid(),
                   served_model_name=config.served_model_name, max_model_len=config.max_model_len,
                   max_new_tokens=config.max_new_tokens, buffer_bytes=config.refit.buffer_bytes,
                   num_buffers=config.refit.num_buffers, refit_fanout=config.refit.fanout,
                   ranks_per_worker=config.ranks_per_worker,
                   device=config.device, collective_backend=fleet.collective_backend,
                   processes=processes, door_url=door.url if door else "")

    def write(self, path: str | Path) -> Path:
        """Write the file readable by its owner only (it carries the control secret); a reader
        sees the old file or the new one, never half of one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its old mode otherwise
        with os.fdopen(fd, "w") as out:
            json.dump(attrs.asdict(self), out, indent=1)
        os.replace(partial, path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> "FleetFile":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise InvalidValue(_FLAG, str(path), f"cannot be read: {exc.strerror} "
                               "(is `rollout-fleet serve` running?)") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidValue(_FLAG, str(path), f"is not a fleet file (not JSON: {exc})") from None
        if not isinstance(data, dict):
            raise InvalidValue(_FLAG, str(path), "is not a fleet file (not a JSON object)")
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted(a.name for a in attrs.fields(cls)
                         if a.default is attrs.NOTHING and a.name not in data)
        if unknown or missing:
            raise InvalidValue(_FLAG, str(path), f"is not a fleet file (missing keys {missing}, "
                               f"unknown keys {unknown})")
        _check_types(path, data)
        return cls(**data)


def _check_types(path: str | Path, data: dict[str, Any]) -> None:
    checks = {"frontend_url": str, "door_url": str, "secret": str, "serve_pid": int, "control_urls": dict,
              "served_model_name": str, "max_model_len": int, "max_new_tokens": int}
    for key, kind in checks.items():
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], kind)):
            raise InvalidValue(f"{_FLAG} {path}: {key}", data[key], f"must be a {kind.__name__}")


def check_fleet_running(fleet: FleetFile) -> None:
    """Refuse a fleet file whose ``serve`` process has exited (the fleet is gone with it)."""
    if not os.path.exists(f"/proc/{fleet.serve_pid}"):
        raise RolloutFleetError(f"the fleet's serve process {fleet.serve_pid} is gone: is "
                                "`rollout-fleet serve` still running?")
