"""The memory engine's sleep and wake (``ports.engine.Sleeper``): ``MemorySleep``, a part of
``MemoryEngine``.

Its "KV cache" is the model's cache of logprob rows; its weights are the two matrices. Level 1
frees the cache and keeps the weights; level 2 forgets the weights too (both matrices become
None) until a refit loads new ones, as a vLLM engine's weights are gone after its level-2
sleep. Asleep, every rollout is refused with ``EngineAsleep``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.sleep import SleepTracker
from rollout_fleet.core.sleep_state import DEFAULT_SLEEP_MODE, WAKE_TAGS, SleepState
from rollout_fleet.ports.engine import Sleeper

if TYPE_CHECKING:
    from rollout_fleet.adapters.memory.engine import MemoryEngine

_DRAIN_POLL_S = 0.001


class MemorySleep(Sleeper):
    """The sleep part of ``MemoryEngine``: it owns the sleep state and the gate kept rollouts
    wait at, and acts on the engine through its public parts (``model``, ``in_flight``,
    ``abort``)."""

    def __init__(self, engine: MemoryEngine) -> None:
        self.engine = engine
        self.tracker = SleepTracker()
        # Set exactly while the engine serves; cleared while asleep (kept rollouts wait at it).
        # The engine reads it on every token, without a call into this part.
        self.serving_gate = asyncio.Event()
        self.serving_gate.set()

    async def sleep(self, level: int = 1, *, mode: str = DEFAULT_SLEEP_MODE) -> SleepState:
        wanted = self.tracker.wants_sleep(level, mode)
        if wanted is None:
            return self.tracker.state
        level, mode = wanted
        engine = self.engine
        self.tracker.fell_asleep(level)  # new rollouts are refused from here on
        self.serving_gate.clear()  # kept ones stop at their next token
        if mode == "abort":
            for request_id in list(engine.in_flight):
                await engine.abort(request_id)
        if mode in ("wait", "abort"):
            while engine.in_flight:  # bounded by the control's timeout
                await asyncio.sleep(_DRAIN_POLL_S)
        engine.model.clear_cache()  # the KV cache is freed (kept rollouts recompute)
        if level >= 2:
            engine.model.forget_weights()
        return self.tracker.state

    async def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> SleepState:
        waking = self.tracker.wants_wake(tags)
        if waking:
            self.tracker.woke(waking)
        self._open_if_serving()
        return self.tracker.state

    def sleep_state(self) -> SleepState:
        return self.tracker.state

    def resident(self) -> dict[str, bool]:
        """What the engine holds now: its weights, and its KV cache (tests read it)."""
        return {"weights": self.engine.model.holds_weights,
                "kv_cache": "kv_cache" not in self.tracker.state.asleep}

    # -- what serving and refit ask of it (a serving engine: one look at the tracker's field) ---
    def check_serving(self) -> None:
        self.tracker.check_serving()

    def check_refit_allowed(self, names: Sequence[str]) -> None:
        if self.tracker.serving:  # awake, with its weights
            return
        self.tracker.check_refit_allowed()
        if self.tracker.state.weights_lost and set(names) != {"embed.weight", "lm_head.weight"}:
            raise RefitError("this engine's weights were dropped by a level-2 sleep: a refit"
                             " must carry every weight (embed.weight, lm_head.weight)")

    def loaded_by_refit(self) -> None:
        if not self.tracker.serving:  # weights a level-2 sleep dropped are back
            self.tracker.refit_loaded()
            self._open_if_serving()

    def _open_if_serving(self) -> None:
        if self.tracker.state.serving:
            self.serving_gate.set()

    def sleep_stats(self) -> Mapping[str, Any]:
        return {**self.tracker.state.to_wire(), "resident": self.resident()}
