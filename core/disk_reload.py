"""A refit from a checkpoint folder, as a worker serves it: the ``check_checkpoint`` and
``reload_weights`` controls over an engine implementing ``DiskReloadTarget``, and the one
message the driver sends (``DiskReload``). The driver's fan-out is
``RefitCoordinator.reload_weights`` (core/refit_service.py): every worker checks the folder
first, so a folder any of them refuses pauses none; then each loads it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
from rollout_fleet.core.clock import Clock, SystemClock
from rollout_fleet.core.engine_ports import DiskReloadTarget
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import RefitMode, next_version
from rollout_fleet.core.validate import is_finite_number, is_int

Handler = Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]
DISK_RELOAD_CONTROLS = ("check_checkpoint", "reload_weights")


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidValue("path", value, "must be a checkpoint folder's path (a non-empty string)")
    return value


def _mode(value: Any) -> RefitMode:
    return RefitMode.parse(value, "mode")


def _version(value: Any) -> int | None:
    if value is not None and (not is_int(value) or value < 1):
        raise InvalidValue("weight_version", value, "must be an int >= 1, or absent")
    return value


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    if not is_finite_number(value) or value <= 0:
        raise InvalidValue("deadline_s", value, "must be a finite number > 0, or absent")
    return float(value)


@attrs.frozen
class DiskReload:
    """One worker's reload: the folder, what happens to the rollouts in flight (keep: frozen,
    then continued on the new weights), the version to set (the fleet's; absent: the worker's
    + 1) and how long the worker may take before it abandons the reload."""

    path: str = attrs.field(converter=_path)
    mode: RefitMode = attrs.field(default=RefitMode.KEEP, converter=_mode)
    weight_version: int | None = attrs.field(default=None, converter=_version)
    deadline_s: float | None = attrs.field(default=None, converter=_deadline)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"path": self.path, "mode": self.mode.value}
        if self.weight_version is not None:
            wire["weight_version"] = self.weight_version
        if self.deadline_s is not None:
            wire["deadline_s"] = self.deadline_s
        return wire

    @classmethod
    def from_wire(cls, body: Any) -> "DiskReload":
        if not isinstance(body, Mapping) or "path" not in body:
            raise InvalidValue("path", None, "the control body must carry the checkpoint folder")
        unknown = sorted(set(body) - {"path", "mode", "weight_version", "deadline_s"})
        if unknown:
            raise InvalidValue("reload_weights", unknown, "unknown field(s)")
        return cls(body["path"], body.get("mode", RefitMode.KEEP.value),
                   body.get("weight_version"), body.get("deadline_s"))


class WorkerDiskReload:
    """A worker's disk reload controls over its engine (a ``DiskReloadTarget``)."""

    def __init__(self, target: DiskReloadTarget, *, clock: Clock | None = None) -> None:
        self._target = target
        self._clock = clock or SystemClock()

    def controls(self) -> dict[str, Handler]:
        return {"check_checkpoint": self.check_checkpoint, "reload_weights": self.reload_weights}

    async def check_checkpoint(self, body: Mapping[str, Any]) -> dict[str, Any]:
        path = _path(body.get("path") if isinstance(body, Mapping) else None)
        return (await self._target.check_checkpoint(path)).to_wire()

    async def reload_weights(self, body: Mapping[str, Any]) -> dict[str, Any]:
        reload = DiskReload.from_wire(body)
        next_version(self._target.weight_version(), reload.weight_version)  # refuse first
        started = self._clock.monotonic()
        version = await self._target.reload_from_disk(
            reload.path, mode=reload.mode, version=reload.weight_version,
            deadline_s=reload.deadline_s)
        return {"weight_version": version, "seconds": round(self._clock.monotonic() - started, 6)}


def refusing_disk_reload(engine: str) -> dict[str, Handler]:
    """The disk reload controls of a worker whose engine (named ``engine``) does not implement
    ``DiskReloadTarget``: each refuses, naming the engine, before anything changes."""

    async def refuse(body: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(f"the {engine} engine does not reload its weights from a"
                                  " checkpoint folder; refit it over the collective instead"
                                  " (rollout-fleet refit --checkpoint)")

    return {name: refuse for name in DISK_RELOAD_CONTROLS}
