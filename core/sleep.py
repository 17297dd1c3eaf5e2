"""Sleep and wake of an engine that shares its device with a trainer (colocated RL).

Between generation phases a colocated engine gives its memory back to the trainer and takes
it back before the next batch, as vLLM's sleep mode does:

    level 1   the KV cache is freed; the weights are kept (vLLM copies them to host memory)
    level 2   the KV cache and the weights are freed: after the wake the engine has no
              weights, and refuses rollouts until a refit has loaded them

What sleep does to the rollouts in flight (``mode``, vLLM's pause modes):

    wait      (the default) they finish first, then the engine sleeps: nothing is lost. A
              colocated trainer asks for sleep once its batch is done (NeMo-RL's
              ``finish_generation``), so there is normally nothing to wait for.
    abort     they end now, with what they generated (finish reason ``abort``)
    keep      they are frozen where they are and continue after the wake (their KV is
              recomputed: it was freed); level 1 only. A drain-mode refit waits for them, so
              refit a kept engine in keep or recompute mode

Wake takes tags, as vLLM's ``wake_up(tags)``: ``weights`` (back before a refit, so the
trainer's weights can land) and ``kv_cache``; none means both. The engine serves again once
both are back and, after a level-2 sleep, a refit has succeeded.

A sleep while asleep at that level, or a wake while awake, changes nothing and says so.

Services: ``SleepTracker`` (one per engine: the state and its transitions, shared by every
engine adapter), ``WorkerSleep`` (a worker's ``sleep`` / ``wake_up`` / ``is_sleeping``
controls over an engine implementing ``ports.engine.Sleeper``) and ``SleepCoordinator`` (the
driver's side, across the colocated workers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.control import WorkerControl
from rollout_fleet.core.fanout import call_everywhere
from rollout_fleet.core.engine_ports import Sleeper
from rollout_fleet.core.errors import EngineAsleep, InvalidValue
from rollout_fleet.core.sleep_state import (
    WAKE_TAGS,
    SleepState,
    sleep_level,
    sleep_mode,
    wake_tags,
)


class SleepTracker:
    """One engine's sleep state and the rules of its transitions (pure; the engine adapter
    does the freeing and calls back here)."""

    def __init__(self) -> None:
        self.state = SleepState()
        # ``state.serving``, kept as a field: engines read it on every rollout.
        self.serving = True

    def _moved_to(self, state: SleepState) -> SleepState:
        self.state, self.serving = state, state.serving
        return state

    def wants_sleep(self, level: Any, mode: Any = None) -> tuple[int, str] | None:
        """The checked ``(level, mode)`` to fall asleep with; None when already asleep at that
        level (nothing to do). A different level while asleep is refused: wake it first."""
        level, mode = sleep_level(level), sleep_mode(mode)
        if mode == "keep" and level >= 2:
            raise InvalidValue("mode", mode, "a level-2 sleep drops the weights the kept rollouts"
                               " would continue on: use wait or abort")
        if not self.state.sleeping:
            return level, mode
        if level == self.state.level:
            return None
        raise InvalidValue("level", level, f"the engine is asleep at level {self.state.level}:"
                           " wake it first (wake_up) to sleep at another level")

    def fell_asleep(self, level: int) -> SleepState:
        return self._moved_to(SleepState(level, frozenset(WAKE_TAGS),
                                         self.state.weights_lost or level >= 2))

    def wants_wake(self, tags: Any = None) -> tuple[str, ...]:
        """The checked tags still asleep among those asked for; empty: nothing to do."""
        asked = wake_tags(tags)
        return tuple(tag for tag in asked if tag in self.state.asleep)

    def woke(self, tags: Collection[str]) -> SleepState:
        asleep = self.state.asleep - set(tags)
        return self._moved_to(attrs.evolve(self.state, asleep=asleep, level=self.state.level
                                           if asleep or self.state.weights_lost else 0))

    def check_refit_allowed(self) -> None:
        """A refit needs the weights' memory back (``wake_up(tags=["weights"])`` first)."""
        if "weights" in self.state.asleep:
            raise EngineAsleep(self.state.level)

    def refit_loaded(self) -> SleepState:
        """A refit succeeded: the weights are the trainer's again."""
        if self.state.weights_lost:
            self._moved_to(attrs.evolve(self.state, weights_lost=False,
                                        level=self.state.level if self.state.asleep else 0))
        return self.state

    def refusal(self) -> EngineAsleep | None:
        """Why a rollout is refused now (asleep, or woke without weights); None: it serves."""
        if self.state.sleeping:
            return EngineAsleep(self.state.level)
        if self.state.weights_lost:
            return EngineAsleep(2, weights_lost=True)
        return None

    def check_serving(self) -> None:
        refusal = self.refusal()
        if refusal is not None:
            raise refusal


Handler = Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]


class WorkerSleep:
    """A worker's sleep controls over its engine (a ``ports.engine.Sleeper``)."""

    def __init__(self, target: Sleeper) -> None:
        self._target = target

    def controls(self) -> dict[str, Handler]:
        return {"sleep": self.sleep, "wake_up": self.wake_up, "is_sleeping": self.is_sleeping}

    async def sleep(self, body: Mapping[str, Any]) -> dict[str, Any]:
        body = body if isinstance(body, Mapping) else {}
        before = self._target.sleep_state()
        state = await self._target.sleep(sleep_level(body.get("level")),
                                         mode=sleep_mode(body.get("mode")))
        return {**state.to_wire(), "changed": state != before}

    async def wake_up(self, body: Mapping[str, Any]) -> dict[str, Any]:
        body = body if isinstance(body, Mapping) else {}
        before = self._target.sleep_state()
        state = await self._target.wake_up(wake_tags(body.get("tags")))
        return {**state.to_wire(), "changed": state != before}

    async def is_sleeping(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._target.sleep_state().to_wire()


class SleepCoordinator:
    """The driver's side: sleep or wake every colocated worker (one control call each, all
    at once, bounded by a timeout); WorkerFailures names each worker that failed."""

    def __init__(self, controls: Sequence[WorkerControl], *, timeout_s: float = 600.0) -> None:
        self._controls = list(controls)
        self.timeout_s = timeout_s

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(c.worker_id for c in self._controls)

    def keep_only(self, worker_ids: Collection[str]) -> None:
        """Forget the workers not in ``worker_ids`` (lost ones)."""
        self._controls = [c for c in self._controls if c.worker_id in worker_ids]

    def add(self, controls: Sequence[WorkerControl]) -> None:
        known = set(self.worker_ids)
        self._controls.extend(c for c in controls if c.worker_id not in known)

    async def sleep(self, level: Any = None, mode: Any = None) -> dict[str, SleepState]:
        body = {"level": sleep_level(level), "mode": sleep_mode(mode)}
        return await self._everywhere("sleep", body)

    async def wake_up(self, tags: Any = None) -> dict[str, SleepState]:
        return await self._everywhere("wake_up", {"tags": list(wake_tags(tags))})

    async def states(self) -> dict[str, SleepState]:
        return await self._everywhere("is_sleeping", {})

    async def _everywhere(self, step: str, body: Mapping[str, Any]) -> dict[str, SleepState]:
        answers = await call_everywhere(self._controls, step, body, self.timeout_s)
        return {worker: SleepState.from_wire(answer) for worker, answer in answers.items()}
