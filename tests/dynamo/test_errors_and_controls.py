"""Bad requests and engine failures give clear client errors and leave the worker serving;
the control channel reaches the engine and refuses what it must; everything on loopback."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from rollout_fleet.adapters.dynamo import FrontendError
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import completion_body, parse_completion_answer
from tests.dynamo.conftest import SERVED_MODEL
from tests.support import group_members, listening_sockets, non_loopback_listeners

pytestmark = pytest.mark.dynamo


def rollout_body(request_id: str = "ok", **overrides) -> dict:
    body = completion_body(RolloutRequest(request_id=request_id, prompt_token_ids=[3, 4],
                                          max_new_tokens=8), SERVED_MODEL)
    body.update(overrides)
    return body


def with_annotation(annotation: str) -> dict:
    body = rollout_body()
    body["nvext"]["annotations"] = [annotation]
    return body


def post(fleet, body: dict) -> httpx.Response:
    return httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)


def assert_still_serving(fleet) -> None:
    answer = post(fleet, rollout_body("after-error"))
    assert answer.status_code == 200, answer.text
    assert len(parse_completion_answer(answer.content).token_ids) == 8


def spec_with(**changes) -> str:
    annotation = rollout_body()["nvext"]["annotations"][0]
    prefix, spec = annotation.split(":", 1)
    return f"{prefix}:{json.dumps({**json.loads(spec), **changes})}"


@pytest.mark.parametrize("annotation,expected", [
    ("rollout:{not json", "rollout annotation is not JSON"),
    ("rollout:[1, 2]", "must hold a JSON object"),
    (spec_with(max_new_tokens=-3), "max_new_tokens"),
    (spec_with(greedy="yes"), "greedy"),
], ids=["not-json", "not-object", "bad-budget", "bad-greedy"])
def test_malformed_annotation_is_a_clear_400(fleet, annotation, expected):
    answer = post(fleet, with_annotation(annotation))
    assert answer.status_code == 400
    assert expected in answer.json()["message"]
    assert_still_serving(fleet)


def test_unknown_spec_version_is_a_clear_400(fleet):
    answer = post(fleet, with_annotation(spec_with(v=99)))
    assert answer.status_code == 400
    message = answer.json()["message"]
    assert "version 99" in message and "v=1" in message
    assert_still_serving(fleet)


def test_a_request_the_engine_rejects_is_a_clear_400(fleet):
    # The engine refuses a budget beyond its context (256): EngineRejected inside serve_rollout.
    body = with_annotation(spec_with(max_new_tokens=1000))
    answer = post(fleet, body)
    assert answer.status_code == 400
    message = answer.json()["message"]
    assert message.startswith("request rejected: EngineRejected") and "context_length=256" in message
    assert_still_serving(fleet)


def test_control_reaches_the_engine(fleet):
    before = fleet.control("engine_stats").json()
    assert before["status"] == "ok"
    assert_still_serving(fleet)
    after = fleet.control("engine_stats").json()
    assert after["served_count"] == before["served_count"] + 1
    assert fleet.control("flush_cache").json() == {"status": "ok", "weight_version": 0}
    assert fleet.control("weight_version").json() == {"status": "ok", "weight_version": 0}
    stats = fleet.control("stats").json()
    assert stats["status"] == "ok" and stats["served"] >= 1 and stats["in_flight"] == 0


def test_unknown_control_is_refused(fleet):
    answer = fleet.control("format_disk")
    assert answer.status_code == 404
    assert "unknown control 'format_disk'" in answer.json()["message"]


@pytest.mark.parametrize("body", [b'"flush_cache"', b"[1, 2]", b"{not json", b"7"],
                         ids=["string", "list", "not-json", "number"])
@pytest.mark.parametrize("name", ["format_disk", "flush_cache", "stats"])
def test_without_the_secret_only_401_is_said_whatever_the_name_or_body(fleet, name, body):
    # No control's name and no judgement of the body reach a caller without the secret.
    for answer in (fleet.control(name, secret=None), fleet.control(name, secret="wrong"),
                   httpx.post(f"{fleet.system_url}/engine/control/{name}", content=body,
                              headers={"content-type": "application/json"}, timeout=10)):
        assert answer.status_code == 401, (answer.status_code, answer.text)
        message = answer.json()["message"]
        assert message.startswith("control refused: ") and "control_secret" in message
        assert "flush_cache" not in message and "stats" not in message and "JSON object" not in message


@pytest.mark.parametrize("secret", [None, "wrong-secret", ""], ids=["missing", "wrong", "empty"])
def test_control_without_the_secret_is_refused(fleet, secret):
    before = fleet.control("engine_stats").json()
    answer = fleet.control("flush_cache", secret=secret)
    assert answer.status_code == 401
    body = answer.json()
    assert body["status"] == "error" and "control_secret" in body["message"]
    assert fleet.control("engine_stats").json() == before  # nothing ran


def test_a_control_with_the_secret_answers_200_and_health_and_metrics_still_answer(fleet):
    answer = fleet.control("stats")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"
    health = httpx.get(f"{fleet.system_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ready"
    metrics = httpx.get(f"{fleet.system_url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "rollout_fleet_generated_tokens" in metrics.text


def test_wait_for_an_unlisted_model_fails_with_the_log(fleet):
    with pytest.raises(FrontendError) as failure:
        fleet.frontend.wait_for_model("no-such-model", timeout_s=1.0)
    message = str(failure.value)
    assert "no-such-model" in message and SERVED_MODEL in message and "log" in message


def test_every_listening_socket_is_on_loopback(fleet):
    pids = {os.getpid()}
    for leader in (fleet.worker.pid, fleet.frontend.process.pid):
        pids.update(group_members(leader))
    listeners = listening_sockets(pids)
    ports = {s.port for s in listeners}
    assert int(fleet.url.rsplit(":", 1)[1]) in ports  # the check sees the frontend's socket
    assert int(fleet.system_url.rsplit(":", 1)[1]) in ports  # and the worker's system port
    assert non_loopback_listeners(pids) == []
