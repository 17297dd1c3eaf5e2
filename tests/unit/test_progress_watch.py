"""The hang watchdog's rule, and the memory engine's freeze drill that it must notice."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import MemoryEngine
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.progress_watch import ProgressWatch
from rollout_fleet.core.rollout import SamplingSpec


def test_a_busy_engine_without_progress_is_hung_after_the_timeout():
    watch = ProgressWatch(5.0)
    assert watch.observe(0.0, 7, busy=True) is None
    assert watch.observe(4.9, 7, busy=True) is None
    assert watch.observe(5.0, 7, busy=True) == 5.0


def test_progress_restarts_the_clock():
    watch = ProgressWatch(5.0)
    watch.observe(0.0, 1, busy=True)
    assert watch.observe(4.0, 2, busy=True) is None
    assert watch.observe(8.0, 2, busy=True) is None
    assert watch.observe(9.0, 2, busy=True) == 5.0


def test_an_idle_engine_is_never_hung():
    watch = ProgressWatch(5.0)
    for now in (0.0, 10.0, 100.0):
        assert watch.observe(now, 3, busy=False) is None
    # work arrives: the clock starts then, not at the last progress
    assert watch.observe(101.0, 3, busy=True) is None
    assert watch.observe(105.0, 3, busy=True) is None
    assert watch.observe(106.0, 3, busy=True) == 5.0


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "5"])
def test_a_bad_timeout_names_the_field(value):
    with pytest.raises(InvalidValue) as caught:
        ProgressWatch(value)
    assert caught.value.field == "hang_timeout_s"


def test_a_frozen_memory_engine_stops_progress_without_failing():
    async def scenario():
        engine = MemoryEngine(seed=0, token_delay_s=0.001)
        before = engine.progress()
        served = await engine.serve_rollout([3, 4], request_id="a", max_new_tokens=5,
                                            sampling=SamplingSpec(greedy=True))
        assert engine.progress() == before + len(served.token_ids)
        engine.freeze()
        waiting = asyncio.ensure_future(engine.serve_rollout(
            [3, 4], request_id="b", max_new_tokens=5, sampling=SamplingSpec(greedy=True)))
        frozen_at = engine.progress()
        done, _ = await asyncio.wait([waiting], timeout=0.3)
        assert not done and engine.progress() == frozen_at and engine.dead_reason() is None
        waiting.cancel()
    asyncio.run(scenario())
