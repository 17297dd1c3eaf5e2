"""A refit step relayed down real workers (core/control_relay.py): local memory-engine worker
processes behind their HTTP control ports, each passing the driver's call on to its children
over HTTP with the fleet's secret; a lost and a frozen worker named, the rest answering."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest

from rollout_fleet.adapters.http import HttpWorkerControl
from rollout_fleet.core.errors import ControlRefused, NotReached
from rollout_fleet.core.fanout import ControlCall, run_calls
from rollout_fleet.core.refit_service import RefitCoordinator
from rollout_fleet.wiring.fleet import call_control
from tests.faults.conftest import run, start_fleet  # noqa: F401 - the fixture
from tests.support.drills import FaultDrills

pytestmark = pytest.mark.dynamo


class CountedControl(HttpWorkerControl):
    """The driver's channel to one worker, counting the calls the driver itself makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    async def call(self, name: str, body: Mapping[str, Any], *, timeout_s: float | None = None
                   ) -> Mapping[str, Any]:
        self.calls.append(name)
        return await super().call(name, body, timeout_s=timeout_s)


def controls_of(fleet) -> list[CountedControl]:
    return [CountedControl(name, url, secret=fleet.secret) for name, url in fleet.control_urls.items()]


def test_the_driver_calls_two_heads_and_every_worker_runs_the_step(start_fleet):
    fleet = start_fleet(workers=5)
    controls = controls_of(fleet)
    coordinator = RefitCoordinator(controls, timeout_s=30, relay_width=2)
    assert run(coordinator.weight_versions()) == {name: 0 for name in fleet.control_urls}
    run(coordinator.invalidate_caches())
    assert [c.calls for c in controls] == [["relay", "relay"]] * 2 + [[]] * 3
    resets = [call_control(url, "engine_stats", fleet.secret)["cache_resets"]
              for url in fleet.control_urls.values()]
    assert resets == [1] * 5


def test_a_lost_head_and_a_frozen_leaf_are_named_and_the_others_answer(start_fleet):
    fleet = start_fleet(workers=5)
    names = list(fleet.control_urls)  # heads 0 and 1; 0 -> 2, 3; 1 -> 4
    drills = FaultDrills(fleet)
    drills.kill_worker(names[1])
    drills.pause_worker(names[3])
    try:
        outcome = run(run_calls([ControlCall(c, "weight_version", {}) for c in controls_of(fleet)],
                                4.0, relay_width=2))
    finally:
        drills.resume_worker(names[3])
    assert outcome[names[0]] == outcome[names[2]] == {"status": "ok", "weight_version": 0}
    assert isinstance(outcome[names[1]], Exception) and not isinstance(outcome[names[1]], Mapping)
    frozen = outcome[names[3]]
    assert isinstance(frozen, ControlRefused), frozen
    assert "the relay to it failed" in str(frozen) and "no answer within 3.5 s" in str(frozen)
    below_lost = outcome[names[4]]
    assert isinstance(below_lost, NotReached)
    assert f"not answered: the relay through worker {names[1]!r} failed" in str(below_lost)


def test_a_step_that_failed_below_a_lost_head_runs_again_on_the_survivors(start_fleet):
    """worker-0 heads worker-2 and worker-3: killed, the fleet's driver's cache flush fails on
    it and reaches neither; once the fleet reports it lost, the flush runs again on the four
    survivors (a tree of their own) and reaches every one."""
    fleet = start_fleet(workers=5)
    generation = fleet.generation(control_relay_width=2)
    try:
        assert generation.invalidate_kv_cache() is True
        FaultDrills(fleet).kill_worker("worker-0")
        deadline = time.monotonic() + 60
        while "worker-0" not in fleet.lost_workers():
            assert time.monotonic() < deadline, "the fleet never reported worker-0 lost"
            time.sleep(0.2)
        assert generation.invalidate_kv_cache() is True
        survivors = [f"worker-{i}" for i in range(1, 5)]
        assert list(generation.worker_ids) == survivors
        resets = {name: call_control(fleet.control_urls[name], "engine_stats",
                                     fleet.secret)["cache_resets"] for name in survivors}
        # The first flush everywhere; the failed one reached worker-1 and, through it, worker-4;
        # the one on the survivors reached all four.
        assert resets == {"worker-1": 3, "worker-2": 2, "worker-3": 2, "worker-4": 3}
    finally:
        generation.shutdown()
