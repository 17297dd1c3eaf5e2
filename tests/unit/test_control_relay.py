"""Control calls relayed down a tree of workers (core/control_relay.py), over in-process
workers: the tree's shape, who the driver calls, each worker's answer or failure, and what is
refused by name."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from rollout_fleet.adapters.memory import LocalWorkerControl, MemoryEngine
from rollout_fleet.core.control_relay import (
    RELAY_CONTROL,
    ControlRelay,
    RelayRequest,
    answers_from,
    check_relay_width,
    relay_forest,
)
from rollout_fleet.core.errors import ControlRefused, InvalidValue, NotReached, WorkerFailures
from rollout_fleet.core.fanout import ControlCall, relayed_plan, run_calls
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerWeights


class Workers:
    """``count`` in-process workers, each serving the refit target's controls and ``relay``,
    reachable by address; ``broken`` ones refuse every call."""

    def __init__(self, count: int) -> None:
        self.engines = [MemoryEngine(0) for _ in range(count)]
        self.broken: set[str] = set()
        self.controls = [self._worker(f"w{i}", engine) for i, engine in enumerate(self.engines)]
        self.by_address = {c.relay_address(): c for c in self.controls}

    def _worker(self, name: str, engine: MemoryEngine) -> LocalWorkerControl:
        handlers: dict[str, Any] = dict(WorkerWeights(engine).controls())
        relay = ControlRelay(answers_from(handlers), self._peer)
        handlers.update(relay.controls())
        return LocalWorkerControl(name, {n: self._unless_broken(name, h) for n, h in handlers.items()},
                                  address=f"mem://{name}")

    def _unless_broken(self, name: str, handler: Any) -> Any:
        async def answer(body: Mapping[str, Any]) -> Mapping[str, Any]:
            if name in self.broken:
                raise ConnectionError(f"{name} is gone")
            return await handler(body)
        return answer

    def _peer(self, worker_id: str, address: str) -> LocalWorkerControl:
        control = self.by_address[address]
        assert control.worker_id == worker_id
        return control

    def driver_calls(self) -> dict[str, list[str]]:
        return {c.worker_id: list(c.calls) for c in self.controls if c.calls}


def calls_of(workers: Workers, step: str, body: Mapping[str, Any] | None = None) -> list[ControlCall]:
    return [ControlCall(c, step, body or {}) for c in workers.controls]


def test_the_forest_holds_every_worker_once_with_width_children_at_most():
    members = [(f"w{i}", f"a{i}") for i in range(100)]
    forest = relay_forest(members, 4)
    assert [head.worker_id for head in forest] == ["w0", "w1", "w2", "w3"]
    everyone = [m for head in forest for m in head.members()]
    assert sorted(everyone) == sorted(w for w, _ in members)

    def check(node, depth: int) -> int:
        assert len(node.children) <= 4
        return max([depth] + [check(child, depth + 1) for child in node.children])

    assert max(check(head, 1) for head in forest) == 4  # 4 + 16 + 64 + the last 16


def test_the_driver_calls_only_the_heads_and_every_worker_answers():
    workers = Workers(11)
    calls = calls_of(workers, "weight_version")
    plan = relayed_plan(calls, 3)
    assert plan is not None
    assert [(head.worker_id, node.worker_id) for head, node in plan] == [("w0", "w0"),
                                                                         ("w1", "w1"),
                                                                         ("w2", "w2")]
    outcome = asyncio.run(run_calls(calls, 5.0, relay_width=3))
    assert list(outcome) == [f"w{i}" for i in range(11)]
    assert all(answer == {"status": "ok", "weight_version": 0} for answer in outcome.values())
    # Each worker was called once, with the relay: by the driver (a head) or by its parent.
    assert workers.driver_calls() == {f"w{i}": [RELAY_CONTROL] for i in range(11)}


def test_a_refused_step_is_refused_for_that_worker_alone():
    workers = Workers(5)
    outcome = asyncio.run(run_calls(calls_of(workers, "no_such_control"), 5.0, relay_width=2))
    assert all(isinstance(r, ControlRefused) and "no_such_control" in str(r)
               for r in outcome.values())
    assert "'w3'" in str(outcome["w3"])


def test_a_lost_worker_fails_with_its_subtree_named_and_the_others_answer():
    workers = Workers(7)  # heads w0, w1; w0 -> w2, w3; w1 -> w4, w5; w2 -> w6
    workers.broken = {"w2", "w1"}
    outcome = asyncio.run(run_calls(calls_of(workers, "weight_version"), 5.0, relay_width=2))
    assert outcome["w0"] == outcome["w3"] == {"status": "ok", "weight_version": 0}
    assert isinstance(outcome["w2"], ControlRefused) and "relay to it failed" in str(outcome["w2"])
    assert isinstance(outcome["w6"], NotReached)
    assert "not reached: the relay through worker 'w2'" in str(outcome["w6"])
    assert isinstance(outcome["w1"], ConnectionError) and "w1 is gone" in str(outcome["w1"])
    for below in ("w4", "w5"):
        assert isinstance(outcome[below], NotReached)
        assert "the relay through worker 'w1' failed" in str(outcome[below])


def test_the_coordinator_relays_its_steps_and_names_each_failure():
    workers = Workers(6)
    coordinator = RefitCoordinator(workers.controls, timeout_s=5.0, relay_width=2)
    asyncio.run(coordinator.invalidate_caches())
    assert [engine.cache_resets for engine in workers.engines] == [1] * 6
    assert {len(calls) for calls in workers.driver_calls().values()} == {1}
    workers.broken = {"w5"}
    with pytest.raises(WorkerFailures, match=r"flush_cache failed on 1 worker\(s\): w5:"):
        asyncio.run(coordinator.invalidate_caches())


@pytest.mark.parametrize("why, calls_of_workers, width", [
    ("no relay asked", lambda w: calls_of(w, "weight_version"), 0),
    ("no more workers than the width", lambda w: calls_of(w, "weight_version"), 5),
    ("bodies differ", lambda w: [ControlCall(c, "flush_cache", {"i": i})
                                 for i, c in enumerate(w.controls)], 2),
    ("steps differ", lambda w: calls_of(w, "weight_version")[:4] + calls_of(w, "flush_cache")[4:], 2),
])
def test_calls_go_out_directly_where_a_relay_does_not_fit(why, calls_of_workers, width):
    assert relayed_plan(calls_of_workers(Workers(5)), width) is None, why


def test_a_worker_its_peers_cannot_reach_is_called_directly():
    engine = MemoryEngine(0)
    unreachable = [LocalWorkerControl(f"w{i}", WorkerWeights(engine).controls()) for i in range(5)]
    assert relayed_plan([ControlCall(c, "weight_version", {}) for c in unreachable], 2) is None
    outcome = asyncio.run(run_calls([ControlCall(c, "weight_version", {}) for c in unreachable],
                                    5.0, relay_width=2))
    assert all(c.calls == ["weight_version"] for c in unreachable)
    assert len(outcome) == 5


@pytest.mark.parametrize("body, field", [
    ({"worker": "w0", "step": "relay", "body": {}, "timeout_s": 1}, "relay.step"),
    ({"worker": "", "step": "flush_cache", "body": {}, "timeout_s": 1}, "relay.worker"),
    ({"worker": "w0", "step": "flush_cache", "body": [], "timeout_s": 1}, "relay.body"),
    ({"worker": "w0", "step": "flush_cache", "body": {}, "timeout_s": 0}, "relay.timeout_s"),
    ({"worker": "w0", "step": "flush_cache", "body": {}, "timeout_s": 1,
      "children": [{"worker": "w1"}]}, "relay.children[0].address"),
])
def test_a_malformed_relay_is_refused_naming_the_field(body, field):
    with pytest.raises(InvalidValue) as refused:
        RelayRequest.from_wire(body)
    assert refused.value.field == field


@pytest.mark.parametrize("width", [1, -2, 2.5, True, "8"])
def test_a_width_that_builds_no_tree_is_refused(width):
    with pytest.raises(InvalidValue, match="control_relay_width"):
        check_relay_width(width)
