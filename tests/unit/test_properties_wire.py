"""Hostile input for the wire codecs: any input parses or raises a WireError, never another exception.

Round trips: what the driver encodes, the worker decodes to the same values (and back).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollout_fleet.core.errors import (
    AnnotationError,
    InvalidValue,
    SpecVersionError,
    UnreadableBody,
    WireError,
)
from rollout_fleet.core.rollout import (
    FinishReason,
    RolloutRequest,
    SamplingSpec,
    ServedRollout,
    Usage,
    version_runs,
)
from rollout_fleet.core.wire import (
    ROLLOUT_ANNOTATION_PREFIX,
    RolloutSpec,
    completion_body,
    decode_rollout_annotation,
    encode_rollout_annotation,
    engine_data_of,
    find_annotation,
    parse_completion_answer,
    served_from_engine_data,
)
from tests.unit.hostile import finite_json, json_values, mutated, nested, python_values

# ---------------------------------------------------------------- valid values

token_ids = st.lists(st.integers(0, 2**40), max_size=12)
samplings = st.builds(
    SamplingSpec,
    greedy=st.booleans(),
    temperature=st.floats(min_value=1e-6, max_value=1e6) | st.integers(1, 10),
    top_p=st.floats(min_value=1e-6, max_value=1.0),
    top_k=st.just(-1) | st.integers(1, 2**31),
    seed=st.none() | st.integers(0, 2**63 - 1),
)
stop_lists = st.lists(st.text(min_size=1, max_size=8), max_size=4)
requests = st.builds(
    RolloutRequest,
    request_id=st.text(min_size=1, max_size=20),
    prompt_token_ids=token_ids.filter(bool),
    max_new_tokens=st.integers(0, 2**31),
    sampling=samplings,
    stop_strings=stop_lists,
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
)


@st.composite
def served_rollouts(draw):
    ids = draw(token_ids)
    logprobs = draw(st.none() | st.lists(st.floats(max_value=0.0, allow_nan=False,
                                                   allow_infinity=False),
                                         min_size=len(ids), max_size=len(ids)))
    return ServedRollout(
        token_ids=ids, logprobs=logprobs,
        finish_reason=draw(st.sampled_from(FinishReason)),
        usage=Usage(prompt_tokens=draw(st.integers(0, 2**31)), completion_tokens=len(ids)),
        routed_experts=draw(finite_json),
        weight_version=draw(st.none() | st.integers(0, 2**62)),
        weight_versions=draw(version_runs_of(len(ids))),
    )


@st.composite
def version_runs_of(draw, n_tokens):
    """Run-length versions tagging ``n_tokens`` tokens: cut points and a version per run."""
    if n_tokens == 0:
        return ()
    cuts = sorted(draw(st.sets(st.integers(1, n_tokens - 1), max_size=3))) if n_tokens > 1 else []
    bounds = [0, *cuts, n_tokens]
    return tuple((draw(st.integers(0, 2**62)), end - start)
                 for start, end in zip(bounds, bounds[1:]))


VALID_SPEC = json.loads(encode_rollout_annotation(
    RolloutRequest("r-1", (1, 2), 8, SamplingSpec(greedy=False, seed=3), ("\n",))
).removeprefix(ROLLOUT_ANNOTATION_PREFIX))
VALID_ENGINE_DATA = {"v": 1, "token_ids": [4, 5], "logprobs": [-0.5, -1.0], "finish_reason": "stop",
                     "prompt_tokens": 3, "routed_experts": None, "weight_version": 2}


def _answer(engine_data) -> bytes:
    return json.dumps({"id": "cmpl-1", "choices": [{"text": ""}],
                       "nvext": {"engine_data": engine_data}}).encode()


def _decode_or_wire_error(annotation) -> RolloutSpec | None:
    try:
        return decode_rollout_annotation(annotation)
    except AnnotationError:
        return None


# ---------------------------------------------------------------- annotation

@settings(max_examples=100)
@given(st.text() | st.text().map(ROLLOUT_ANNOTATION_PREFIX.__add__) | python_values)
def test_any_annotation_decodes_or_raises_annotation_error(annotation):
    _decode_or_wire_error(annotation)


@settings(max_examples=120)
@given(mutated(VALID_SPEC) | json_values)
def test_any_spec_json_decodes_to_a_valid_spec_or_raises_annotation_error(spec):
    try:
        text = json.dumps(spec)
    except (ValueError, TypeError, RecursionError):  # huge ints, deep nesting: send hostile text
        text = "[" * 100_000
    decoded = _decode_or_wire_error(ROLLOUT_ANNOTATION_PREFIX + text)
    if decoded is not None:  # a spec that decodes is a request the engine can serve
        request = decoded.to_request([1])
        assert request.request_id == spec["request_id"] and spec["v"] == 1
        assert isinstance(decoded.stop_strings, tuple)


@pytest.mark.parametrize("version", [True, 1.0, "1", [1], None, 2])
def test_a_spec_version_that_only_compares_equal_to_1_is_refused(version):
    # Found by the property above: {"v": true} passed as version 1 because True == 1.
    with pytest.raises(SpecVersionError, match="version"):
        decode_rollout_annotation(ROLLOUT_ANNOTATION_PREFIX + json.dumps({**VALID_SPEC, "v": version}))


def test_a_huge_integer_temperature_is_a_bad_field_not_an_overflow():
    # Found by the property above: math.isfinite(10**400) raised OverflowError.
    annotation = ROLLOUT_ANNOTATION_PREFIX + json.dumps({**VALID_SPEC, "temperature": 10**400})
    with pytest.raises(AnnotationError, match="temperature"):
        decode_rollout_annotation(annotation)


def test_a_deeply_nested_spec_is_an_annotation_error():
    with pytest.raises(AnnotationError):
        decode_rollout_annotation(ROLLOUT_ANNOTATION_PREFIX + "[" * 200_000)
    with pytest.raises(AnnotationError, match="stop_strings"):
        decode_rollout_annotation(ROLLOUT_ANNOTATION_PREFIX + json.dumps(
            {**VALID_SPEC, "stop_strings": nested(900)}))


@settings(max_examples=120)
@given(requests)
def test_annotation_round_trips_every_valid_request(request):
    spec = decode_rollout_annotation(encode_rollout_annotation(request))
    assert spec == RolloutSpec(request.request_id, request.max_new_tokens, request.sampling,
                               request.stop_strings, ignore_eos=request.ignore_eos,
                               logprobs=request.logprobs)
    assert spec.to_request(request.prompt_token_ids) == request


@settings(max_examples=200)
@given(requests, st.lists(st.integers(0, 2**40), max_size=3))
def test_the_annotation_is_the_text_json_dumps_writes(request, stop_token_ids):
    request = RolloutRequest(request.request_id, request.prompt_token_ids, request.max_new_tokens,
                             request.sampling, request.stop_strings, stop_token_ids,
                             ignore_eos=request.ignore_eos, logprobs=request.logprobs)
    s = request.sampling
    spec = {"v": 1, "request_id": request.request_id, "max_new_tokens": request.max_new_tokens,
            "greedy": s.greedy, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "seed": s.seed, "stop_strings": list(request.stop_strings)}
    if stop_token_ids:
        spec["stop_token_ids"] = stop_token_ids
    if request.ignore_eos:
        spec["ignore_eos"] = True
    if not request.logprobs:
        spec["logprobs"] = False
    expected = ROLLOUT_ANNOTATION_PREFIX + json.dumps(spec, separators=(",", ":"))
    assert encode_rollout_annotation(request) == expected


@settings(max_examples=100)
@given(requests, st.text(max_size=10))
def test_completion_body_is_strict_json_carrying_the_request(request, model):
    body = json.loads(json.dumps(completion_body(request, model), allow_nan=False))
    assert body["prompt"] == list(request.prompt_token_ids)
    assert body["max_tokens"] == request.max_new_tokens and body["model"] == model
    annotation = find_annotation(body["nvext"]["annotations"], ROLLOUT_ANNOTATION_PREFIX)
    assert decode_rollout_annotation(annotation).to_request(body["prompt"]) == request
    if request.sampling.greedy:
        assert body["temperature"] == 0.0 and "seed" not in body
    else:
        assert body["temperature"] == request.sampling.temperature
        assert body.get("seed") == request.sampling.seed


@given(st.lists(python_values | st.text(max_size=12).map("rollout:".__add__), max_size=6) | python_values,
       st.text(max_size=9) | st.just(ROLLOUT_ANNOTATION_PREFIX))
def test_find_annotation_never_raises(annotations, prefix):
    found = find_annotation(annotations, prefix)
    assert found is None or (isinstance(found, str) and found.startswith(prefix) and found in annotations)
    if isinstance(annotations, list):
        assert found == next((a for a in annotations if isinstance(a, str) and a.startswith(prefix)), None)


@pytest.mark.parametrize("annotations", [5, 1.5, True, {"rollout:": 1}.keys()])
def test_annotations_that_are_not_a_list_hold_no_rollout(annotations):
    # Found by the property above: iterating an int raised TypeError.
    assert find_annotation(annotations, ROLLOUT_ANNOTATION_PREFIX) is None


# ---------------------------------------------------------------- engine data and answers

@settings(max_examples=120)
@given(served_rollouts())
def test_engine_data_round_trips_through_json_and_the_answer(served):
    data = engine_data_of(served)
    assert served_from_engine_data(json.loads(json.dumps(data, allow_nan=False))) == served
    assert parse_completion_answer(_answer(data)) == served
    assert parse_completion_answer(_answer(data).decode()) == served


@settings(max_examples=120)
@given(mutated(VALID_ENGINE_DATA) | python_values)
def test_any_engine_data_reads_or_raises_wire_error(data):
    try:
        served = served_from_engine_data(data)
    except WireError:
        return
    assert len(served.token_ids) == len(served.logprobs) == served.usage.completion_tokens
    assert all(lp <= 0.0 for lp in served.logprobs)
    assert served.weight_version is None or served.weight_version >= 0


@example(b"")
@example(b"\xef\xbb\xbf{}")
@example(b"[" * 200_000)
@example(b'{"nvext": {"engine_data": ' + b"[" * 200_000)
@settings(max_examples=100)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_any_body_reads_or_raises_wire_error(body):
    with pytest.raises(WireError):  # random bytes are never a whole rollout answer
        parse_completion_answer(body)


@settings(max_examples=120)
@given(st.dictionaries(st.sampled_from(["status", "error", "message", "nvext", "choices"]), json_values)
       | st.builds(lambda d: {"nvext": {"engine_data": d}}, mutated(VALID_ENGINE_DATA) | json_values))
def test_any_json_answer_reads_or_raises_wire_error(answer):
    try:
        body = json.dumps(answer).encode()
    except (ValueError, TypeError, RecursionError):  # huge ints, deep nesting: not a JSON text
        return
    try:
        parsed = parse_completion_answer(body)
    except WireError:
        return
    # An answer that reads is its engine_data, decoded: nothing else in the body changes it.
    assert parsed == served_from_engine_data(json.loads(body)["nvext"]["engine_data"])


@settings(max_examples=50)
@given(served_rollouts(), st.data())
def test_a_truncated_answer_is_unreadable(served, data):
    body = _answer(engine_data_of(served))
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(UnreadableBody):
        parse_completion_answer(body[:cut])


@settings(max_examples=120)
@given(served_rollouts(), st.data())
def test_a_corrupted_answer_reads_or_raises_wire_error(served, data):
    body = bytearray(_answer(engine_data_of(served)))
    index = data.draw(st.integers(0, len(body) - 1))
    body[index] = data.draw(st.integers(0, 255).filter(lambda b: b != body[index]))
    try:
        parse_completion_answer(bytes(body))
    except WireError:
        pass


def test_huge_integer_logprob_is_a_wire_error_not_an_overflow():
    # Found by a property above: float(-10**400) raised OverflowError.
    with pytest.raises(WireError, match=r"logprobs\[0\]"):
        served_from_engine_data({**VALID_ENGINE_DATA, "logprobs": [-(10**400), -1.0]})


@pytest.mark.parametrize("version", ["abc", -1, True, 1.5, [1]])
def test_engine_data_refuses_a_weight_version_that_is_not_a_count(version):
    # Found by a property above: any JSON value passed through as the weight version.
    with pytest.raises(WireError, match="weight_version"):
        served_from_engine_data({**VALID_ENGINE_DATA, "weight_version": version})


@pytest.mark.parametrize("body", [None, 17, {"nvext": {}}, ["x"]])
def test_an_answer_that_is_not_bytes_or_text_is_a_wire_error(body):
    # Found by a property above: json.loads raised TypeError.
    with pytest.raises(WireError, match="bytes or str"):
        parse_completion_answer(body)


@given(served_rollouts())
def test_weight_versions_survive_the_wire_and_tag_every_token(served):
    decoded = served_from_engine_data(json.loads(json.dumps(engine_data_of(served))))
    assert decoded.weight_versions == served.weight_versions
    assert not decoded.weight_versions or \
        sum(n for _, n in decoded.weight_versions) == len(decoded.token_ids)


@pytest.mark.parametrize("runs, culprit", [
    ([[1, 1]], "tag every generated token"),  # 2 tokens, 1 tagged
    ([[1, 1], [2, 2]], "tag every generated token"),  # 3 tagged
    ([[-1, 2]], "weight_versions[0][0]"),
    ([[1, 0], [2, 2]], "weight_versions[0][1]"),
    ([[1, True], [2, 1]], "weight_versions[0][1]"),
    ([[1, 1, 1]], "weight_versions[0]"),
    ("11", "weight_versions"),
    ([[1, 0]], "weight_versions[0][1]"),  # one run: the fast path must refuse as the loop does
    ([[True, 2]], "weight_versions[0][0]"),
    ([[1.0, 2]], "weight_versions[0][0]"),
    ([[1, 2.0]], "weight_versions[0][1]"),
    ([[1]], "weight_versions[0]"),
    (["12"], "weight_versions[0]"),
])
def test_engine_data_refuses_bad_weight_versions(runs, culprit):
    with pytest.raises(WireError, match=re.escape(culprit)):
        served_from_engine_data({**VALID_ENGINE_DATA, "weight_versions": runs})


@given(st.one_of(st.integers(-3, 3), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2)),
       st.one_of(st.integers(-3, 3), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2)),
       st.sampled_from([list, tuple]))
def test_one_version_run_is_kept_or_refused_by_its_field(version, count, kind):
    convert = version_runs("weight_versions")
    valid = type(version) is int and type(count) is int and version >= 0 and count >= 1
    if valid:
        assert convert([kind((version, count))]) == ((version, count),)
    else:
        with pytest.raises(InvalidValue, match=re.escape("weight_versions[0]")):
            convert([kind((version, count))])


def test_engine_data_without_runs_tags_the_whole_rollout_with_its_version():
    served = served_from_engine_data(VALID_ENGINE_DATA)
    assert served.weight_versions == ((2, 2),)
