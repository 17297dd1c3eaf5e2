"""The memory engine's test controls, served by its worker only with ``engine.test_controls =
true`` (the project's tests set it; off by default): ``engine_stats`` (what reached the engine
itself) and the fault drills ``kill_engine`` and ``freeze_engine``. Off, each is refused,
naming the setting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.ports.engine_kind import Control

RECENT_ABORTS = 256  # how many aborted request ids engine_stats reports


def testing_controls(engine: MemoryEngine, enabled: bool) -> Mapping[str, Control]:
    """The controls a memory worker serves beside its engine's own."""
    controls = _controls_of(engine)
    if enabled:
        return controls
    return {name: _refused(name) for name in controls}


def _controls_of(engine: MemoryEngine) -> dict[str, Control]:
    async def engine_stats(_body: dict[str, Any]) -> dict[str, Any]:
        return {"aborted_ids": list(engine.aborted_ids[-RECENT_ABORTS:]),
                "served_count": engine.served_count, "in_flight": sorted(engine.in_flight),
                "started_as": engine.started_as, "cache_resets": engine.cache_resets}

    async def kill_engine(body: dict[str, Any]) -> dict[str, Any]:
        # The engine dies as a killed engine process would; the worker leaves.
        engine.die(str(body.get("reason") or "killed by the kill_engine control"))
        return {"in_flight": len(engine.in_flight)}

    async def freeze_engine(_body: dict[str, Any]) -> dict[str, Any]:
        # The engine hangs (alive, no progress); the worker's watchdog must notice.
        engine.freeze()
        return {"in_flight": len(engine.in_flight)}

    return {"engine_stats": engine_stats, "kill_engine": kill_engine, "freeze_engine": freeze_engine}


def _refused(name: str) -> Control:
    async def refuse(_body: dict[str, Any]) -> dict[str, Any]:
        raise InvalidValue("engine.test_controls", False, f"{name} is a test control, served only"
                           " by a memory worker whose config sets test_controls = true")
    return refuse
