"""The door's trajectory store (SQLite, shared by the door's processes): bounded as the
in-memory store is (least recently used past its capacity, idle entries forgotten), exact to the
bit, seen by every connection at once, and kept when the process that wrote it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
from rollout_fleet.core.agent_turns import (
    RecordedTurn, Trajectories, TrajectoryNotHeld, TurnTokens, check_trajectory_held,
)
from rollout_fleet.core.errors import InvalidValue

TURN = RecordedTurn(3, ("system", "user", "tool"), TurnTokens(
    [1, 2, 2**31 - 1, 0], [7, 8, 2], [-0.1, -1e-12, -123.456789012345678],
    weight_version=4, weight_versions=[(3, 1), (4, 2)]), worker=17560018053143703542)  # Dynamo's ids: u64


@pytest.fixture(params=["sqlite", "memory"])
def store(request, tmp_path):
    if request.param == "memory":
        return Trajectories(capacity=2, idle_s=10.0)
    return SqliteTrajectories(tmp_path / "door.sqlite", capacity=2, idle_s=10.0)


def test_a_turn_comes_back_exactly(store):
    store.record("a", TURN, now=0.0)
    assert store.latest("a", now=1.0) == TURN
    assert store.latest("b", now=1.0) is None


def test_past_its_capacity_the_least_recently_recorded_goes(store):
    store.record("a", TURN, now=0.0)
    store.record("b", TURN, now=1.0)
    store.record("a", TURN, now=2.0)  # "a" is now the most recently used
    store.record("c", TURN, now=3.0)
    assert [store.latest(n, now=4.0) is not None for n in "abc"] == [True, False, True]
    assert len(store) == 2


def test_an_idle_trajectory_is_forgotten_and_an_ended_one_is_gone(store):
    store.record("a", TURN, now=0.0)
    store.record("b", TURN, now=5.0)
    assert store.latest("a", now=10.0) is None and store.latest("b", now=10.0) == TURN
    assert store.end("b") and not store.end("b")
    store.record("c", TURN, now=20.0)  # a write also deletes what idled
    assert len(store) == 1


def test_sessions_are_pinned_to_their_last_worker_and_bounded_alike(store):
    assert store.pinned_worker("s", now=0.0) is None
    store.pin("s", 11, now=0.0)
    store.pin("s", 2**64 - 1, now=1.0)
    assert store.pinned_worker("s", now=2.0) == 2**64 - 1
    assert store.pinned_worker("s", now=11.0) is None  # idle
    store.pin("t", 1, now=20.0)
    store.pin("u", 2, now=21.0)
    store.pin("v", 3, now=22.0)
    assert [store.pinned_worker(n, now=23.0) for n in "tuv"] == [None, 2, 3]


def test_bad_bounds_are_refused_by_name(tmp_path):
    with pytest.raises(InvalidValue, match="trajectories"):
        SqliteTrajectories(tmp_path / "door.sqlite", capacity=0)
    with pytest.raises(InvalidValue, match="trajectories"):
        Trajectories(idle_s=0)


def test_every_connection_sees_each_others_turns_at_once(tmp_path):
    one = SqliteTrajectories(tmp_path / "door.sqlite", capacity=8, idle_s=60.0)
    two = SqliteTrajectories(tmp_path / "door.sqlite", capacity=8, idle_s=60.0)
    one.record("a", TURN, now=0.0)
    assert two.latest("a", now=1.0) == TURN
    two.record("a", RecordedTurn(5, TURN.roles + ("assistant", "user"), TURN.tokens), now=2.0)
    assert one.latest("a", now=3.0).message_count == 5
    assert two.end("a") and one.latest("a", now=4.0) is None


def test_a_turn_recorded_by_a_process_that_is_then_killed_is_kept(tmp_path):
    """The recording process dies by SIGKILL right after its write returned (no close, no
    checkpoint): the write-ahead log holds the turn for every other process."""
    path = tmp_path / "door.sqlite"
    SqliteTrajectories(path)  # the file and its tables
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys
        from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
        from rollout_fleet.core.agent_turns import RecordedTurn, TurnTokens
        store = SqliteTrajectories({str(path)!r})
        store.record("kept", RecordedTurn(1, ("user",), TurnTokens([1, 2], [3])), now=1.0)
        print("recorded", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)], stdout=subprocess.PIPE, text=True)
    out, _ = writer.communicate(timeout=60)
    assert out.strip() == "recorded" and writer.returncode == -signal.SIGKILL
    assert os.path.getsize(f"{path}-wal") > 0  # the turn is in the log, not yet in the file
    kept = SqliteTrajectories(path).latest("kept", now=2.0)
    assert kept is not None and kept.tokens.all_token_ids == (1, 2, 3)


def test_door_processes_opening_a_new_store_at_the_same_instant_all_open_it(tmp_path):
    """The switch to the write-ahead log takes an exclusive lock that SQLite's busy wait does
    not cover: a 16-core machine's door processes, opening a new store together, raced on it."""
    path, start_at, count = tmp_path / "door.sqlite", time.time() + 3.0, 12
    openers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
        from rollout_fleet.core.agent_turns import RecordedTurn, TurnTokens
        time.sleep(max(0.0, {start_at} - time.time()))
        store = SqliteTrajectories({str(path)!r})
        store.record("t{index}", RecordedTurn(1, ("user",), TurnTokens([1, 2], [3])), now=1.0)
        """)], stderr=subprocess.PIPE, text=True) for index in range(count)]
    ended = [(opener.wait(timeout=60), opener.stderr.read()) for opener in openers]
    assert [code for code, _ in ended] == [0] * count, [why for code, why in ended if code]
    assert len(SqliteTrajectories(path)) == count


def test_a_forgotten_trajectory_continued_without_tokens_is_refused_by_its_name():
    roles = ["user", "assistant", "tool"]
    with pytest.raises(TrajectoryNotHeld) as refused:
        check_trajectory_held("weather-9", None, roles, {})
    assert refused.value.field == "trajectory" and refused.value.value == "weather-9"
    assert "messages[1]" in str(refused.value)
    check_trajectory_held("weather-9", TURN, roles, {})  # held
    check_trajectory_held("weather-9", None, roles, {1: TURN.tokens})  # tokens carried
    check_trajectory_held("weather-9", None, ["user"], {})  # its first turn
    check_trajectory_held(None, None, roles, {})  # no trajectory: rendered afresh
