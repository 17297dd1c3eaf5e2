"""The values of an engine's sleep (``core/sleep.py`` tells the levels, modes and tags): the
choices, their parse functions and ``SleepState``. Their own module, so the ports declaring
``Sleeper`` and the services driving it both import them without importing each other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.errors import InvalidValue

SLEEP_LEVELS = (1, 2)
SLEEP_MODES = ("wait", "abort", "keep")
DEFAULT_SLEEP_LEVEL = 1
DEFAULT_SLEEP_MODE = "wait"
WAKE_TAGS = ("weights", "kv_cache")


def sleep_level(value: Any) -> int:
    """``value`` checked as a sleep level (None: the default)."""
    if value is None:
        return DEFAULT_SLEEP_LEVEL
    if isinstance(value, bool) or value not in SLEEP_LEVELS:
        raise InvalidValue("level", value, "must be 1 (free the KV cache, keep the weights) or 2"
                           " (free the weights too: a refit must follow before serving)")
    return int(value)


def sleep_mode(value: Any) -> str:
    """``value`` checked as a sleep mode (None: the default)."""
    if value is None:
        return DEFAULT_SLEEP_MODE
    if value not in SLEEP_MODES:
        raise InvalidValue("mode", value, f"must be one of {', '.join(SLEEP_MODES)} (what happens"
                           " to the rollouts in flight)")
    return str(value)


def wake_tags(value: Any) -> tuple[str, ...]:
    """``value`` checked as wake tags; None (or empty) wakes everything."""
    if value is None:
        return WAKE_TAGS
    if isinstance(value, str) or not isinstance(value, Sequence) \
            or not all(isinstance(tag, str) and tag in WAKE_TAGS for tag in value):
        raise InvalidValue("tags", value, f"must be a list of {', '.join(WAKE_TAGS)} (or null:"
                           " both)")
    return tuple(tag for tag in WAKE_TAGS if tag in value) or WAKE_TAGS


@attrs.frozen
class SleepState:
    """Where an engine stands: what it has freed, at which level it fell asleep, and whether
    its weights were dropped (level 2) and not yet loaded again by a refit."""

    level: int = 0  # the level of the last sleep, 0 while it never slept or is fully awake
    asleep: frozenset[str] = frozenset()  # of WAKE_TAGS: what is freed now
    weights_lost: bool = False

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    @property
    def serving(self) -> bool:
        return not self.asleep and not self.weights_lost

    def to_wire(self) -> dict[str, Any]:
        return {"sleeping": self.sleeping, "level": self.level, "asleep": sorted(self.asleep),
                "weights_lost": self.weights_lost, "serving": self.serving}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> "SleepState":
        return cls(level=int(data.get("level", 0)), asleep=frozenset(data.get("asleep", ())),
                   weights_lost=bool(data.get("weights_lost", False)))
