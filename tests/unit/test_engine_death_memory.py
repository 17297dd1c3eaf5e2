"""The memory engine's death drill: it fails as a killed engine process does."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.adapters.memory import MemoryEngine
from rollout_fleet.core.errors import EngineDead, EngineError
from rollout_fleet.core.rollout import GREEDY


def test_a_dead_engine_fails_its_rollouts_in_flight_and_every_later_one():
    engine = MemoryEngine(seed=0, token_delay_s=0.01)

    async def scenario():
        assert engine.dead_reason() is None
        in_flight = asyncio.ensure_future(engine.serve_rollout(
            [3, 4], request_id="r1", max_new_tokens=200, sampling=GREEDY))
        while not engine.in_flight:
            await asyncio.sleep(0.001)
        engine.die("test")
        with pytest.raises(EngineDead) as died:
            await in_flight
        with pytest.raises(EngineDead):
            await engine.serve_rollout([3], request_id="r2", max_new_tokens=2, sampling=GREEDY)
        return died.value

    error = asyncio.run(scenario())
    assert isinstance(error, EngineError) and "died (test)" in str(error)
    assert engine.dead_reason() == "the memory engine died (test)"
    assert not engine.in_flight
