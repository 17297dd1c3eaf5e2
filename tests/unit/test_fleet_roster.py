"""The fleet's roster of workers, without a fleet: names never reused, a replacement on the
lost worker's slot, and the steps of adding a worker when its launch or its start fails."""

import pytest

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.ports.placement import WorkerHandle
from rollout_fleet.wiring.fleet_roster import WorkerRoster


def handle(index: int) -> WorkerHandle:
    return WorkerHandle(index=index, name=f"worker-{index}", pid=1000 + index,
                        node_ip="127.0.0.1", ports={}, log_path="")


def roster_of(count: int) -> WorkerRoster:
    roster = WorkerRoster()
    roster.first([handle(i) for i in range(count)])
    return roster


def launched(index: int, slot: int, in_place_of: str, seen: list) -> WorkerHandle:
    seen.append((index, slot, in_place_of))
    return handle(index)


def test_a_replacement_takes_a_new_name_and_the_lost_workers_slot():
    roster, seen = roster_of(3), []
    worker = roster.add("worker-1", launch=lambda *a: launched(*a, seen),
                        wait_ready=lambda _w: None, kill=lambda _n: None)
    assert worker.name == "worker-3" and seen == [(3, 1, "worker-1")]
    assert roster.without_replacement(["worker-1", "worker-2"]) == ["worker-2"]
    roster.add(None, launch=lambda *a: launched(*a, seen), wait_ready=lambda _w: None,
               kill=lambda _n: None)
    assert seen[-1] == (4, 4, "")
    assert [w.name for w in roster.workers] == [f"worker-{i}" for i in range(5)]


def test_an_unknown_worker_cannot_be_replaced():
    with pytest.raises(InvalidValue, match="replacing.*worker-7.*no such worker"):
        roster_of(2).add("worker-7", launch=lambda *a: handle(2), wait_ready=lambda _w: None,
                         kill=lambda _n: None)


def test_a_failed_launch_leaves_the_lost_worker_waiting_for_a_replacement():
    roster = roster_of(2)

    def launch(*_args):
        raise RuntimeError("no resources")

    with pytest.raises(RuntimeError):
        roster.add("worker-0", launch=launch, wait_ready=lambda _w: None, kill=lambda _n: None)
    assert roster.without_replacement(["worker-0"]) == ["worker-0"]
    assert roster.starting == frozenset()
    assert [w.name for w in roster.workers] == ["worker-0", "worker-1"]


def test_a_worker_still_starting_is_not_lost_and_one_that_fails_to_start_is_killed():
    roster, killed, seen_dead = roster_of(1), [], []

    def wait_ready(worker):
        assert roster.starting == {"worker-1"}
        seen_dead.append(roster.dead({"worker-0": True, "worker-1": False}))
        raise TimeoutError("not ready")

    with pytest.raises(TimeoutError):
        roster.add(None, launch=lambda *a: handle(1), wait_ready=wait_ready, kill=killed.append)
    assert seen_dead == [[]] and killed == ["worker-1"]
    assert roster.dead({"worker-0": True, "worker-1": False}) == ["worker-1"]
