"""The http transport's typed answer decoder reads every body as the core's parser does: the same
served rollout, or the same error (type and message)."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollout_fleet.adapters.http.transport import (
    HttpCompletionsTransport, read_completion_answer, served_or_none,
)
from rollout_fleet.core.errors import WireError
from rollout_fleet.core.wire import engine_data_of, parse_completion_answer, refused_engine_data
from tests.unit.hostile import json_values, mutated
from tests.unit.test_properties_wire import VALID_ENGINE_DATA, served_rollouts


def outcome(read, body):
    try:
        return ("read", read(body))
    except WireError as exc:
        return (type(exc).__name__, str(exc))


def answer_of(engine_data, **top) -> bytes:
    return json.dumps({"id": "cmpl-1", "choices": [{"text": "ab", "index": 0}],
                       "usage": {"prompt_tokens": 3}, **top,
                       "nvext": {"engine_data": engine_data}}).encode()


def agrees(body: bytes) -> None:
    assert outcome(read_completion_answer, body) == outcome(parse_completion_answer, body)


@settings(max_examples=150)
@given(served_rollouts())
def test_every_served_rollout_is_read_on_the_fast_path_as_the_core_reads_it(served):
    body = answer_of(engine_data_of(served))
    assert served_or_none(body) == served == parse_completion_answer(body)


@settings(max_examples=300)
@given(mutated(VALID_ENGINE_DATA) | json_values)
def test_any_engine_data_reads_alike_or_fails_alike(data):
    try:
        body = answer_of(data)
    except (ValueError, TypeError, RecursionError):  # not a JSON text
        return
    agrees(body)


@settings(max_examples=150)
@given(st.dictionaries(st.sampled_from(["status", "error", "message", "nvext", "choices"]), json_values))
def test_any_answer_object_reads_alike_or_fails_alike(answer):
    try:
        body = json.dumps(answer).encode()
    except (ValueError, TypeError, RecursionError):
        return
    agrees(body)


@example(b"")
@example(b"\xef\xbb\xbf{}")
@example(b"[" * 200_000)
@example('{"nvext": {"engine_data": {}}}'.encode("utf-16"))
@settings(max_examples=100)
@given(st.binary(max_size=200))
def test_any_bytes_fail_alike(body):
    agrees(body)


@pytest.mark.parametrize("change", [
    {"logprobs": [-0.5, float("nan")]}, {"logprobs": [-0.5, float("-inf")]},
    {"logprobs": [-(10**400), -1.0]}, {"logprobs": [-1, 0]}, {"token_ids": [4, True]},
    {"token_ids": [4, 5.0]}, {"token_ids": [4, 2**70]}, {"v": True}, {"v": 1.0}, {"v": 2},
    {"weight_versions": [[2, 1], [2, 1]]}, {"weight_versions": [[2, 1]]},
    {"weight_versions": None}, {"finish_reason": "done"}, {"prompt_tokens": -1},
    {"routed_experts": [[1, 2**70], 1e300]}, refused_engine_data(503, "asleep"),
    {"refused": {"status": 503, "message": "asleep"}},
])
def test_edge_values_read_alike_or_fail_alike(change):
    agrees(answer_of({**VALID_ENGINE_DATA, **change}))


@pytest.mark.parametrize("top", [{"error": None}, {"status": "error", "message": "x"},
                                 {"status": "ok"}, {"nvext": None}])
def test_an_answer_that_says_it_failed_fails_alike(top):
    body = json.dumps({**json.loads(answer_of(VALID_ENGINE_DATA)), **top}).encode()
    agrees(body)


def test_the_transport_reads_answers_with_the_fast_decoder():
    transport = HttpCompletionsTransport("http://127.0.0.1:1")
    body = answer_of(VALID_ENGINE_DATA)
    assert transport.read_answer(body) == parse_completion_answer(body)
