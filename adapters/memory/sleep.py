"""The memory engine's sleep and wake (``ports.engine.Sleeper``), a part of ``MemoryEngine``.

Its "KV cache" is the model's cache of logprob rows; its weights are the two matrices. Level 1
frees the cache and keeps the weights; level 2 forgets the weights too (both matrices become
None) until a refit loads new ones, as a vLLM engine's weights are gone after its level-2
sleep. Asleep, every rollout is refused with ``EngineAsleep``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.sleep import DEFAULT_SLEEP_MODE, WAKE_TAGS, SleepState, SleepTracker
from rollout_fleet.ports.engine import Sleeper

_DRAIN_POLL_S = 0.001


class MemorySleep(Sleeper):
    """Mixed into ``MemoryEngine``: it uses the engine's ``model``, ``in_flight`` and ``abort``."""

    def _init_sleep(self) -> None:
        self._sleep = SleepTracker()
        self._serving_gate = asyncio.Event()  # cleared while asleep: kept rollouts wait at it
        self._serving_gate.set()

    async def sleep(self, level: int = 1, *, mode: str = DEFAULT_SLEEP_MODE) -> SleepState:
        wanted = self._sleep.wants_sleep(level, mode)
        if wanted is None:
            return self._sleep.state
        level, mode = wanted
        self._sleep.fell_asleep(level)  # new rollouts are refused from here on
        self._serving_gate.clear()  # kept ones stop at their next token
        if mode == "abort":
            for request_id in list(self.in_flight):
                await self.abort(request_id)
        if mode in ("wait", "abort"):
            while self.in_flight:  # bounded by the control's timeout
                await asyncio.sleep(_DRAIN_POLL_S)
        self.model.clear_cache()  # the KV cache is freed (kept rollouts recompute)
        if level >= 2:
            self.model.embed = self.model.lm_head = None  # the weights are forgotten
        return self._sleep.state

    async def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> SleepState:
        waking = self._sleep.wants_wake(tags)
        if waking:
            self._sleep.woke(waking)
        self._open_if_serving()
        return self._sleep.state

    def sleep_state(self) -> SleepState:
        return self._sleep.state

    def resident(self) -> dict[str, bool]:
        """What the engine holds now: its weights, and its KV cache (tests read it)."""
        return {"weights": self.model.embed is not None and self.model.lm_head is not None,
                "kv_cache": "kv_cache" not in self._sleep.state.asleep}

    # -- hooks of the engine --------------------------------------------------------------------
    def _check_serving(self) -> None:
        self._sleep.check_serving()

    async def _wait_while_asleep(self) -> None:
        if not self._serving_gate.is_set():
            await self._serving_gate.wait()

    def _check_refit_allowed(self, names: Sequence[str]) -> None:
        self._sleep.check_refit_allowed()
        if self._sleep.state.weights_lost and set(names) != {"embed.weight", "lm_head.weight"}:
            raise RefitError("this engine's weights were dropped by a level-2 sleep: a refit"
                             " must carry every weight (embed.weight, lm_head.weight)")

    def _loaded_by_refit(self) -> None:
        self._sleep.refit_loaded()
        self._open_if_serving()

    def _open_if_serving(self) -> None:
        if self._sleep.state.serving:
            self._serving_gate.set()

    def sleep_stats(self) -> Mapping[str, Any]:
        return {**self._sleep.state.to_wire(), "resident": self.resident()}
