"""The door's controls and a captured turn, in front of a stand-in frontend (test_door_hop.py's)
with staging in memory: a control is refused for its secret before anything else (401), then
by name (404) and by field (400); a setup whose staging cannot be reached is taken back (503);
a captured call before any setup is a 503, after it a turn staged exactly as the engine made
it and answered with its coordinates only; the setup's sampling profiles guard every chat. A
checkpoint's generation fence holds a new call before the frontend while frozen and its
finished turn before staging until released, and a pause that cannot drain a turn being staged
is a 504 that leaves the fence frozen. The real fleet's capture is tested in
tests/fleet/test_nemo_rl_contract.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from rollout_fleet.adapters.agent_door.app import CaptureParts, door_apps
from rollout_fleet.adapters.agent_door.door_state import DoorState, SharedState
from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.adapters.transfer_queue import InMemoryStaging
from rollout_fleet.core.capture_records import StagingChainBroken, StagingUnavailable
from tests.unit.test_door_hop import GENERATED, MAX_MODEL_LEN, Frontend, Served
from tests.unit.test_door_hop import model as model  # noqa: F401 - the tokenizer fixture

SECRET = "door-secret"
DP_CFG = {"impl": "transfer_queue", "backend": "simple"}


@pytest.fixture(scope="module")
def frontend():
    stand_in = Frontend()
    served = Served(stand_in.app())
    stand_in.url = served.url
    yield stand_in
    served.stop()


class SlowStaging(InMemoryStaging):
    """Stages once ``go`` is set (``entered`` says a turn is being staged)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.go = threading.Event(), threading.Event()

    def stage(self, row):
        self.entered.set()
        assert self.go.wait(30)
        super().stage(row)


@pytest.fixture
def door(frontend, model, tmp_path):
    staging = InMemoryStaging()
    slow = SlowStaging()

    def staging_of(settings):
        if settings.staging_partition == "unreachable":
            raise StagingUnavailable("no TransferQueue controller runs in this Ray cluster")
        return slow if settings.staging_partition == "slow" else staging

    store = tmp_path / "door.sqlite"
    parts = CaptureParts(SharedState(DoorState(store)), staging_of, control_secret=SECRET)
    apps = door_apps(frontend.url, ChatTemplate(str(model), "tiny"),
                     SqliteTrajectories(store), max_model_len=MAX_MODEL_LEN, capture=parts)
    served = Served(apps.public)
    yield served.url, staging, slow
    slow.go.set()
    served.stop()


def control(url, name, **body):
    return httpx.post(f"{url}/door/control/{name}", json=body, timeout=30)


def test_a_control_is_refused_for_its_secret_first_then_by_name_then_by_field(door):
    url, _staging, _slow = door
    for body in ({}, {"control_secret": "wrong"}, {"control_secret": 7}):
        assert control(url, "no_such_control", **body).status_code == 401
    assert httpx.post(f"{url}/door/control/setup_token_capture", content=b"[",
                      timeout=30).status_code == 401
    assert control(url, "no_such_control", control_secret=SECRET).status_code == 404
    for fields, param in (({"dp_cfg": DP_CFG}, "staging_partition"),
                          ({"dp_cfg": {"impl": "local"}, "staging_partition": "s"}, "dp_cfg"),
                          ({"dp_cfg": DP_CFG, "staging_partition": "s",
                            "generation_prefix_cuts_enabled": True},
                           "generation_cut_control_token")):
        refused = control(url, "setup_token_capture", control_secret=SECRET, **fields)
        assert (refused.status_code, refused.json()["param"]) == (400, param)
    unreachable = control(url, "setup_token_capture", control_secret=SECRET, dp_cfg=DP_CFG,
                          staging_partition="unreachable")
    assert unreachable.status_code == 503 and "controller" in unreachable.json()["error"]
    status = control(url, "token_capture_status", control_secret=SECRET).json()
    assert status == {"status": "ok", "set_up": False, "weight_version": 0}


def captured(url, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 1.0, "top_p": 1.0,
            "ng_capture": {"rollout_id": "r", "model_call_id": "c", "mode": "text"}, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_a_captured_turn_is_staged_as_made_and_answered_with_its_coordinates(door, frontend):
    url, staging, _slow = door
    assert captured(url).status_code == 503
    set_up = control(url, "setup_token_capture", control_secret=SECRET, dp_cfg=DP_CFG,
                     staging_partition="s", sampling={"temperature": 1.0, "top_p": 1.0})
    assert set_up.status_code == 200 and set_up.json()["setup"] == 1, set_up.text
    assert control(url, "set_rollout_weight_version", control_secret=SECRET,
                   version=5).status_code == 200
    answered = captured(url)
    assert answered.status_code == 200, answered.text
    answer = answered.json()
    coords = answer["ng_commit_coords"]
    assert (coords["disposition"], coords["weight_version"]) == ("staged", 5)
    assert "generation_token_ids" not in answer["choices"][0]["message"]
    (row,) = staging.rows([coords["staging_key"]])
    assert list(row.token_ids_delta[-3:]) == GENERATED and row.digest == coords["digest"]
    assert row.generation_logprobs_delta[-3:] == (-0.5, -0.5, -0.5)
    forwarded = frontend.received[-1]
    assert b"ng_capture" not in forwarded and b'"max_tokens": 4' in forwarded
    off_policy = captured(url, temperature=0.5)
    assert (off_policy.status_code, off_policy.json()["error"]["param"]) == (400, "temperature")
    streamed = captured(url, stream=True)
    assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "stream")
    broken = captured(url, ng_capture={"rollout_id": "r", "model_call_id": "d",
                                       "mode": "token_in", "parent_call_id": "c", "prev_len": 3,
                                       "parent_chain_hash": "a" * 64,
                                       "staging_chain": ["r/c", "r/gone"]})
    assert (broken.status_code, broken.json()["error"]["param"]) == (400, "staging_chain[1]")


def fence(url, name, **body):
    return control(url, name, control_secret=SECRET, **body)


def in_thread(call):
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(call()))
    thread.start()
    return thread, answers


def staged(staging, key) -> bool:
    try:
        return bool(staging.rows([key]))
    except StagingChainBroken:
        return False


def test_the_fence_holds_new_calls_then_finished_turns_until_released(door, frontend):
    url, staging, _slow = door
    assert fence(url, "pause_generation_for_checkpoint", timeout_s=0).json()["param"] == \
        "timeout_s"
    assert fence(url, "setup_token_capture", dp_cfg=DP_CFG, staging_partition="s",
                 sampling={"temperature": 1.0, "top_p": 1.0}).status_code == 200
    paused = fence(url, "pause_generation_for_checkpoint", timeout_s=5).json()
    assert (paused["was"], paused["phase"], paused["door_processes"]) == ("open", "frozen", 1)
    forwarded = len(frontend.received)
    thread, answers = in_thread(lambda: captured(url, ng_capture={
        "rollout_id": "fenced", "model_call_id": "c", "mode": "text"}))
    time.sleep(0.3)
    assert len(frontend.received) == forwarded and not answers  # held before the frontend
    assert fence(url, "resume_generation_after_cut").json()["phase"] == "cut"
    deadline = time.monotonic() + 10
    while len(frontend.received) == forwarded and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert len(frontend.received) == forwarded + 1 and not answers  # decoded, not staged
    assert not staged(staging, "fenced/c")
    released = fence(url, "finish_generation_checkpoint").json()
    assert (released["was"], released["phase"]) == ("cut", "open")
    thread.join(30)
    (answer,) = answers
    assert answer.status_code == 200 and staged(staging, "fenced/c")
    again = fence(url, "resume_generation_after_checkpoint").json()  # a second release: a no-op
    assert (again["was"], again["phase"]) == ("open", "open")
    assert fence(url, "resume_generation_after_cut").json()["phase"] == "open"


def test_a_pause_that_cannot_drain_a_turn_being_staged_is_a_504_and_stays_frozen(door):
    url, _staging, slow = door
    assert fence(url, "setup_token_capture", dp_cfg=DP_CFG, staging_partition="slow",
                 sampling={"temperature": 1.0, "top_p": 1.0}).status_code == 200
    thread, answers = in_thread(lambda: captured(url))
    assert slow.entered.wait(30)  # the turn is being staged, the pause came after
    refused = fence(url, "pause_generation_for_checkpoint", timeout_s=0.3)
    assert refused.status_code == 504 and "did not drain" in refused.json()["error"], refused.text
    assert fence(url, "resume_generation_after_cut").json()["was"] == "frozen"
    slow.go.set()
    thread.join(30)
    assert answers[0].status_code == 200  # its staging was never cut short
    drained = fence(url, "pause_generation_for_checkpoint", timeout_s=5).json()
    assert (drained["was"], drained["phase"]) == ("cut", "frozen")
    assert fence(url, "resume_generation_after_checkpoint").json()["phase"] == "open"
