"""The sleep port's contract suite (``ports.engine.Sleeper``).

Usage, beside the engine contract (the same ``engine_under_test`` fixture)::

    class TestMyEngine(EngineContract, SleeperContract):
        @pytest.fixture
        def reload_weights(self):       # a refit of the engine's own weights, after a level-2
            return lambda eut: ...      # sleep; None when the engine cannot be refit

Each test leaves the engine awake and serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from rollout_fleet.core.errors import EngineAsleep, InvalidValue
from rollout_fleet.core.rollout import GREEDY, ServedRollout
from rollout_fleet.ports.contracts.harness import EngineUnderTest
from rollout_fleet.ports.engine import Sleeper, SleepState

GREEDY_TOKENS = 8  # each prompt's greedy answer, compared before a sleep and after the wake


class SleeperContract:
    def _sleeper(self, eut: EngineUnderTest) -> Sleeper:
        assert isinstance(eut.engine, Sleeper), "the engine does not implement Sleeper"
        return eut.engine

    def _wake(self, eut: EngineUnderTest) -> SleepState:
        return eut.loop.run(self._sleeper(eut).wake_up())

    def test_level_1_refuses_rollouts_and_the_wake_serves_as_before(
            self, engine_under_test: EngineUnderTest) -> None:
        eut = engine_under_test
        before = eut.greedy_answers(GREEDY_TOKENS)
        state = eut.loop.run(self._sleeper(eut).sleep(1))
        try:
            assert state.sleeping and state.level == 1 and not state.serving
            assert self._sleeper(eut).is_sleeping()
            with pytest.raises(EngineAsleep) as refused:
                eut.serve(eut.prompts[0], 8)
            assert refused.value.level == 1 and "asleep (level 1)" in str(refused.value)
            assert "prepare_for_generation" in str(refused.value)
        finally:
            woke = self._wake(eut)
        assert woke.serving and not woke.sleeping and woke.level == 0
        assert eut.greedy_answers(GREEDY_TOKENS) == before

    def test_sleep_while_asleep_and_wake_while_awake_change_nothing(
            self, engine_under_test: EngineUnderTest) -> None:
        eut = engine_under_test
        sleeper = self._sleeper(eut)
        assert self._wake(eut) == sleeper.sleep_state()  # awake: nothing to do
        first = eut.loop.run(sleeper.sleep(1))
        try:
            assert eut.loop.run(sleeper.sleep(1)) == first
            with pytest.raises(InvalidValue) as other_level:
                eut.loop.run(sleeper.sleep(2))
            assert other_level.value.field == "level" and "wake it first" in other_level.value.rule
        finally:
            self._wake(eut)
        assert self._wake(eut).serving

    def test_a_partial_wake_serves_only_once_everything_is_back(
            self, engine_under_test: EngineUnderTest) -> None:
        eut = engine_under_test
        sleeper = self._sleeper(eut)
        eut.loop.run(sleeper.sleep(1))
        try:
            half = eut.loop.run(sleeper.wake_up(["weights"]))
            assert half.asleep == frozenset({"kv_cache"}) and not half.serving
            with pytest.raises(EngineAsleep):
                eut.serve(eut.prompts[0], 8)
        finally:
            state = eut.loop.run(sleeper.wake_up(["kv_cache"]))
        assert state.serving

    def test_bad_levels_and_modes_are_refused_by_name(
            self, engine_under_test: EngineUnderTest) -> None:
        sleeper = self._sleeper(engine_under_test)
        for kwargs, field in (({"level": 3}, "level"), ({"level": 1, "mode": "later"}, "mode"),
                              ({"level": 2, "mode": "keep"}, "mode")):
            with pytest.raises(InvalidValue) as refused:
                engine_under_test.loop.run(sleeper.sleep(**kwargs))
            assert refused.value.field == field
        assert sleeper.sleep_state().serving  # nothing changed

    def test_abort_mode_ends_the_rollouts_in_flight(
            self, engine_under_test: EngineUnderTest) -> None:
        eut = engine_under_test
        sleeper = self._sleeper(eut)

        async def sleep_under_a_rollout() -> ServedRollout:
            rollout = asyncio.ensure_future(eut.engine.serve_rollout(
                list(eut.prompts[0]), request_id=eut.next_id(), max_new_tokens=eut.facts.context_length
                - len(eut.prompts[0]), sampling=GREEDY))
            await asyncio.sleep(0.05)
            await sleeper.sleep(1, mode="abort")
            return await asyncio.wait_for(rollout, 60)

        try:
            served = eut.loop.run(sleep_under_a_rollout())
        finally:
            self._wake(eut)
        assert served.finish_reason.value in ("abort", "length", "stop")
        assert served.logprobs is not None and len(served.token_ids) == len(served.logprobs)

    def test_level_2_drops_the_weights_until_a_refit(
            self, engine_under_test: EngineUnderTest,
            reload_weights: Callable[[EngineUnderTest], Any]) -> None:
        eut = engine_under_test
        before = eut.greedy_answers(GREEDY_TOKENS)
        sleeper = self._sleeper(eut)
        state = eut.loop.run(sleeper.sleep(2))
        assert state.level == 2 and state.weights_lost
        woke = self._wake(eut)
        assert not woke.sleeping and woke.weights_lost and not woke.serving
        with pytest.raises(EngineAsleep) as refused:
            eut.serve(eut.prompts[0], 8)
        assert refused.value.weights_lost and "refit" in str(refused.value)
        reload_weights(eut)
        assert sleeper.sleep_state().serving
        assert eut.greedy_answers(GREEDY_TOKENS) == before

