import json

import pytest

from rollout_fleet.core.errors import (
    AnnotationError, ErrorInBody, LengthMismatch, MissingField, SpecVersionError, UnreadableBody,
    WireError,
)
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec, ServedRollout, Usage
from rollout_fleet.core.wire import (
    ROLLOUT_ANNOTATION_PREFIX, completion_body, decode_rollout_annotation, encode_rollout_annotation,
    engine_data_of, find_annotation, parse_completion_answer, served_from_engine_data,
)

REQUEST = RolloutRequest("req-1", [5, 6, 7], 9,
                         SamplingSpec(greedy=False, temperature=0.7, top_p=0.9, top_k=5, seed=11),
                         stop_strings=["\n\n", "END"])


def answer(engine_data):
    return json.dumps({"choices": [{"text": ""}], "nvext": {"engine_data": engine_data}}).encode()


def test_body_carries_token_prompt_annotation_and_asks_for_engine_data():
    body = completion_body(REQUEST, "tiny")
    assert body["model"] == "tiny" and body["prompt"] == [5, 6, 7] and body["max_tokens"] == 9
    assert body["nvext"]["extra_fields"] == ["engine_data"]
    (annotation,) = body["nvext"]["annotations"]
    assert annotation.startswith(ROLLOUT_ANNOTATION_PREFIX)
    assert json.loads(json.dumps(body)) == body  # plain JSON


def test_greedy_body_sends_temperature_zero():
    body = completion_body(RolloutRequest("g", [1], 2), "tiny")
    assert body["temperature"] == 0.0 and "seed" not in body


def test_annotation_round_trips_the_spec():
    spec = decode_rollout_annotation(encode_rollout_annotation(REQUEST))
    assert spec.to_request([5, 6, 7]) == REQUEST


@pytest.mark.parametrize("annotation, error", [
    ("rollout:{not json", AnnotationError),
    ("rollout:[1,2]", AnnotationError),
    ("other:{}", AnnotationError),
    ('rollout:{"v": 2}', SpecVersionError),
    ('rollout:{"request_id": "x"}', SpecVersionError),
    ('rollout:{"v": 1, "request_id": "x", "greedy": true, "stop_strings": []}', AnnotationError),
    ('rollout:{"v": 1, "request_id": "", "max_new_tokens": 3, "greedy": true, "stop_strings": []}',
     AnnotationError),
    ('rollout:{"v": 1, "request_id": "x", "max_new_tokens": 3, "greedy": true, "stop_strings": "s"}',
     AnnotationError),
])
def test_bad_annotations_are_distinct_clear_errors(annotation, error):
    with pytest.raises(error) as info:
        decode_rollout_annotation(annotation)
    assert str(info.value)


def test_find_annotation_picks_the_prefixed_one():
    assert find_annotation(["a", "rollout:x", "rollout:y"], "rollout:") == "rollout:x"
    assert find_annotation(None, "rollout:") is None


def test_answer_round_trips_a_served_rollout():
    served = ServedRollout((3, 4, 0), (-0.5, -1.0, -2.0), "stop", Usage(3, 3),
                           routed_experts=[[1, 2]], weight_version=4)
    assert parse_completion_answer(answer(engine_data_of(served))) == served


def test_token_ids_and_logprobs_of_different_length_are_refused():
    data = engine_data_of(ServedRollout((3, 4), (-0.5, -1.0), "stop", Usage(3, 2)))
    data["logprobs"] = data["logprobs"][:1]
    with pytest.raises(LengthMismatch) as info:
        parse_completion_answer(answer(data))
    assert "2 token IDs but 1 logprobs" in str(info.value)


@pytest.mark.parametrize("body, error", [
    (b"", UnreadableBody),
    (b'{"choices": [', UnreadableBody),
    (b'{"status": "error", "message": "weights are loading"}', ErrorInBody),
    (b'{"error": {"message": "bad"}}', ErrorInBody),
    (b'{"choices": []}', MissingField),
    (b'{"nvext": {}}', MissingField),
    (b"[]", WireError),
])
def test_bad_answers_are_distinct_errors(body, error):
    with pytest.raises(error):
        parse_completion_answer(body)


@pytest.mark.parametrize("field", ["token_ids", "logprobs", "finish_reason", "prompt_tokens"])
def test_each_missing_engine_data_field_is_named(field):
    data = engine_data_of(ServedRollout((3,), (-0.5,), "stop", Usage(1, 1)))
    del data[field]
    with pytest.raises(MissingField) as info:
        served_from_engine_data(data)
    assert info.value.path == f"nvext.engine_data.{field}"


def test_engine_data_with_a_bad_value_is_a_wire_error():
    data = engine_data_of(ServedRollout((3,), (-0.5,), "stop", Usage(1, 1)))
    data["logprobs"] = [0.5]
    with pytest.raises(WireError):
        served_from_engine_data(data)


def test_a_workers_refusal_in_the_engine_data_reads_as_its_http_status():
    import json as _json

    from rollout_fleet.core.errors import HttpStatusError, WireError
    from rollout_fleet.core.retry import is_transient
    from rollout_fleet.core.wire import parse_completion_answer, refused_engine_data

    body = _json.dumps({"nvext": {"engine_data": refused_engine_data(503, "worker w is asleep")}})
    with pytest.raises(HttpStatusError) as refused:
        parse_completion_answer(body)
    assert refused.value.status == 503 and "worker w is asleep" in str(refused.value)
    assert isinstance(refused.value, WireError) and is_transient(refused.value)
    bad = _json.dumps({"nvext": {"engine_data": {"v": 1, "refused": {"status": 200}}}})
    with pytest.raises(WireError, match="not a refusal"):
        parse_completion_answer(bad)
