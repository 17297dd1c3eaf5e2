"""A worker asleep is not hung: a keep-mode sleep holds its rollouts in flight with no engine
step, and the worker's hang watch must not take that for a hang (it would leave the fleet)."""

from __future__ import annotations

import asyncio

import attrs

from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.core.progress_watch import ProgressWatch
from rollout_fleet.wiring.worker import _hang_reason


@attrs.define
class Serving:
    """What the hang watch reads of the serving adapter: requests waiting, controls running."""

    requests_in_flight: int = 1
    controls_running: int = 0


def test_a_sleeping_engine_with_rollouts_held_is_never_hung():
    engine = MemoryEngine(seed=0)
    watch = ProgressWatch(1e-9)  # any stall at all counts, when busy
    asyncio.run(engine.sleep(1, mode="keep"))
    assert [_hang_reason(engine, Serving(), watch) for _ in range(3)] == [None, None, None]
    asyncio.run(engine.wake_up())
    reasons = [_hang_reason(engine, Serving(), watch) for _ in range(3)]
    assert reasons[-1] is not None and "no step completed" in reasons[-1]  # awake: it counts
