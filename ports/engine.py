"""The engine port and the optional ports an engine may also implement: refit (``RefitTarget``),
reload from disk (``DiskReloadTarget``) and sleep (``Sleeper``); all declared in core
(``rollout_fleet.core.engine``, ``rollout_fleet.core.engine_ports``), where the services that
drive them live."""

from __future__ import annotations

from rollout_fleet.core.engine import (
    OPTIONAL_ROLLOUT_KEYWORDS,
    SAMPLING_OPTIONS,
    EngineFacts,
    EnginePort,
    KvEventSource,
    RolloutPiece,
    offered_keywords,
    streams_without_logprobs,
)
from rollout_fleet.core.engine_ports import (
    DiskReloadTarget,
    RefitByPart,
    RefitTarget,
    Sleeper,
    refit_target,
)
from rollout_fleet.core.sleep_state import SleepState

__all__ = ["OPTIONAL_ROLLOUT_KEYWORDS", "SAMPLING_OPTIONS", "DiskReloadTarget", "EngineFacts",
           "EnginePort", "KvEventSource", "RefitByPart", "RefitTarget", "RolloutPiece", "Sleeper",
           "SleepState", "offered_keywords", "refit_target", "streams_without_logprobs"]
