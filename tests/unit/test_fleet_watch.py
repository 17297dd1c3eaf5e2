"""The fleet's watch over lost workers, without a fleet: the replacement back-off, one watch
round, and the cleanup of a lost worker in a file discovery folder laid out as Dynamo's."""

import threading

import pytest

from rollout_fleet.wiring.fleet_discovery import LostWorkerCleanup, discovery_forgetter
from rollout_fleet.wiring.fleet_watch import ReplacementBackoff, WorkerWatcher


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_backoff_doubles_after_each_failure_up_to_its_cap_and_resets_after_a_success():
    clock = ManualClock()
    backoff = ReplacementBackoff(first_s=1.0, max_s=5.0, clock=clock)
    assert backoff.due()
    assert [backoff.failed() for _ in range(4)] == [2.0, 4.0, 5.0, 5.0]
    assert not backoff.due()
    clock.now += 4.9
    assert not backoff.due()
    clock.now += 0.1
    assert backoff.due()
    backoff.succeeded()
    assert backoff.failed() == 2.0


def _file_discovery(tmp_path, instance_id: int):
    """One registration as Dynamo's file discovery writes it: its key's slashes escaped."""
    folder = tmp_path / "discovery" / "v1" / "instances"
    folder.mkdir(parents=True)
    path = folder / f"v1%2Finstances%2Ffleet%2Fbackend%2Fgenerate%2F{instance_id:x}"
    path.write_text("{}")
    return path


def test_a_lost_worker_leaves_file_discovery_and_is_killed_once(tmp_path):
    registration = _file_discovery(tmp_path, 0xABC123)
    other = _file_discovery(tmp_path / "other", 0xDEF456)
    killed: list[str] = []
    cleanup = LostWorkerCleanup({"worker-0": 0xABC123}, kill=killed.append,
                                forget=discovery_forgetter({}, tmp_path))
    for _ in range(2):
        cleanup.forget_in_discovery(["worker-0", "worker-9"])  # worker-9 never registered
        cleanup.kill_what_is_left_of(["worker-0"])
    assert not registration.exists() and other.exists()
    assert killed == ["worker-0"]


def test_a_worker_that_cannot_be_killed_does_not_stop_the_cleanup_of_the_others(tmp_path):
    killed: list[str] = []

    def kill(name: str) -> None:
        if name == "worker-0":
            raise ProcessLookupError("its node is gone")
        killed.append(name)

    cleanup = LostWorkerCleanup({}, kill=kill, forget=discovery_forgetter({}, tmp_path))
    cleanup.kill_what_is_left_of(["worker-0", "worker-1"])
    assert killed == ["worker-1"]


def test_the_etcd_forgetter_is_chosen_by_the_discovery_env(tmp_path):
    forget = discovery_forgetter({"ETCD_ENDPOINTS": "http://127.0.0.1:9,http://x:1"}, tmp_path)
    with pytest.raises(OSError):  # nothing listens on the discard port: etcd was asked
        forget(1)


def _watcher(lost, replace, clock):
    cleanup = LostWorkerCleanup({}, kill=lambda _name: None, forget=lambda _id: False)
    return WorkerWatcher(lambda: list(lost), cleanup, replace, threading.Event(),
                         backoff=ReplacementBackoff(first_s=1.0, max_s=60.0, clock=clock))


def test_a_failing_replacement_is_tried_again_only_after_its_backoff():
    clock, tries = ManualClock(), []

    def replace(lost):
        tries.append(list(lost))
        raise RuntimeError("no resources")

    watcher = _watcher(["worker-0"], replace, clock)
    assert watcher.round() and watcher.round()  # the second round is within the back-off
    assert tries == [["worker-0"]]
    clock.now += 2.0
    assert watcher.round()
    assert tries == [["worker-0"], ["worker-0"]]


def test_without_replacement_a_round_only_cleans_up_and_a_stopping_fleet_ends_the_watch():
    watcher = _watcher(["worker-0"], None, ManualClock())
    assert watcher.round()
    failing = WorkerWatcher(lambda: (_ for _ in ()).throw(RuntimeError("placement gone")),
                            watcher.cleanup, None, threading.Event())
    assert failing.round()  # a failed round is logged; the watch goes on
    failing.stopping.set()
    assert not failing.round()  # failing because the fleet stops: the watch ends


def test_the_watch_thread_runs_rounds_until_the_fleet_stops():
    rounds = threading.Semaphore(0)
    stopping = threading.Event()
    cleanup = LostWorkerCleanup({}, kill=lambda _name: None, forget=lambda _id: False)

    def lost():
        rounds.release()
        return []

    watcher = WorkerWatcher(lost, cleanup, None, stopping, interval_s=0.01)
    watcher.start()
    assert rounds.acquire(timeout=30) and rounds.acquire(timeout=30)
    stopping.set()
    watcher.join(30)
    assert not watcher._thread.is_alive()
