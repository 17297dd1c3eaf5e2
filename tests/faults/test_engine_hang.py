"""A worker whose engine hangs mid-batch (the memory engine's freeze drill: alive, no progress,
no error): its watchdog takes the engine for hung after ``hang_timeout_s``, answers what waited
on it as a dead engine's (retried on the survivor: each sample exactly once, exact), leaves the
frontend's routing and exits naming why; the fleet reports it lost with that reason, kills what
is left of it and (``replace_lost_workers``) starts a replacement; the next refit forms its
group without it."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.wiring.fleet import call_control
from tests.faults.conftest import check_batch_exactly_once, collect_until_error, mixed_batch, run
from tests.faults.test_replacement import check_batch_served_by, refit
from tests.support import leftover_processes
from tests.support.lost_worker import RoutingProbe, retryable, wait_for_in_flight, wait_until_lost

pytestmark = [pytest.mark.faults, pytest.mark.dynamo, pytest.mark.collective]
MAX_NEW, MAX_LEN = 16, 64
HANG_TIMEOUT_S = 3.0


def wait_for_live(fleet, name: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while name not in [e.worker_id for e in fleet.endpoints(live_only=True)]:
        assert time.monotonic() < deadline, f"{name} did not join within {timeout_s:.0f} s"
        time.sleep(0.2)


def test_an_engine_that_hangs_mid_batch_is_found_its_rollouts_finish_elsewhere_and_it_is_replaced(
        start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.01, replace_lost_workers=True,
                        timeouts={"hang_timeout_s": HANG_TIMEOUT_S})
    hung_group = next(w.pid for w in fleet.workers if w.name == "worker-0")
    prompts, data = mixed_batch(96, seed=23, max_len=20)
    retry = RetryPolicy(max_attempts=8, base_delay_s=0.05, backoff=1.5, max_delay_s=0.5)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=32, retry=retry)
    frozen: dict = {}
    probe = RoutingProbe(fleet.frontend_url, "mem")

    async def batch_with_an_engine_frozen():
        async def freeze_when_busy():
            frozen["in_flight"] = await asyncio.to_thread(wait_for_in_flight, fleet, "worker-0")
            frozen["at"] = time.monotonic()
            await asyncio.to_thread(call_control, fleet.control_urls["worker-0"], "freeze_engine",
                                    fleet.secret)
            probe.start()
            frozen["lost"] = await asyncio.to_thread(wait_until_lost, fleet, "worker-0")
        freeze = asyncio.ensure_future(freeze_when_busy())
        result = await collect_until_error(generation, data)
        await freeze
        return result

    try:
        with probe:
            pairs, error = run(batch_with_an_engine_frozen())
            time.sleep(0.5)  # probes after the worker left
        assert frozen["in_flight"] > 0, "worker-0's engine held no rollout when it froze"
        assert error is None, repr(error)
        check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
        lost = frozen["lost"]
        assert list(lost) == ["worker-0"], lost
        assert lost["worker-0"].startswith("EngineHung: engine hung: no step completed"), lost
        assert f"hang_timeout_s={HANG_TIMEOUT_S:g}" in lost["worker-0"], lost
        refused = probe.refused_after(frozen["at"])
        assert probe.served_after(frozen["at"]) > 0
        assert all(retryable(status) for _, status, _ in refused), refused  # never a 400
        assert leftover_processes([hung_group], wait_s=30) == []  # nothing of it left running

        # Its replacement joins; the next refit forms the group with the survivor and it.
        wait_for_live(fleet, "worker-2")
        assert generation.get_inference_world_size() == 2
        assert generation.worker_ids == ("worker-1", "worker-2")
        assert refit(generation, seed=1) == [1, 1]
        check_batch_served_by(generation, 1, 16, batch_seed=24)
    finally:
        generation.shutdown()
