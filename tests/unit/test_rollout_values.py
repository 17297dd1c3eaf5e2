import math

import pytest

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import (
    FinishReason, RolloutRequest, RolloutResult, SamplingSpec, ServedRollout, Usage,
)


def served(tokens=(1, 2), logprobs=(-0.1, -0.2), finish="stop"):
    return ServedRollout(tokens, logprobs, finish, Usage(3, len(tokens)))


def test_request_is_frozen_and_normalised():
    request = RolloutRequest("r1", [1, 2, 3], 4, stop_strings=["x"])
    assert request.prompt_token_ids == (1, 2, 3)
    assert request.stop_strings == ("x",)
    with pytest.raises(AttributeError):
        request.max_new_tokens = 5


@pytest.mark.parametrize("prompt, field", [
    ([1, -1], "prompt_token_ids[1]"),
    ([1, True], "prompt_token_ids[1]"),
    ([1.0], "prompt_token_ids[0]"),
    ([], "prompt_token_ids"),
    ("abc", "prompt_token_ids[0]"),
])
def test_bad_prompts_name_the_field(prompt, field):
    with pytest.raises(InvalidValue) as info:
        RolloutRequest("r", prompt, 4)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"request_id": ""}, "request_id"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 2.0}, "max_new_tokens"),
    ({"stop_strings": "stop"}, "stop_strings"),
    ({"stop_strings": [""]}, "stop_strings[0]"),
])
def test_bad_request_fields(kwargs, field):
    args = {"request_id": "r", "prompt_token_ids": [1], "max_new_tokens": 3} | kwargs
    with pytest.raises(InvalidValue) as info:
        RolloutRequest(**args)
    assert info.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"greedy": 1}, "greedy"),
])
def test_bad_sampling(kwargs, field):
    with pytest.raises(InvalidValue) as info:
        SamplingSpec(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("logprobs, field", [
    ((-0.1, 0.5), "logprobs[1]"),
    ((-0.1, math.inf), "logprobs[1]"),
    ((-0.1, -math.inf), "logprobs[1]"),
    ((-0.1, math.nan), "logprobs[1]"),
    ((-0.1,), "logprobs"),
    ((-0.1, "x"), "logprobs[1]"),
])
def test_served_rollout_logprobs_are_checked(logprobs, field):
    with pytest.raises(InvalidValue) as info:
        served(logprobs=logprobs)
    assert info.value.field == field


def test_finish_reason_is_a_closed_set():
    with pytest.raises(InvalidValue) as info:
        served(finish="eos")
    assert "finish_reason" in str(info.value) and "eos" in str(info.value)
    assert {r.value for r in FinishReason} == {"stop", "length", "abort"}


def test_usage_must_count_generated_tokens():
    with pytest.raises(InvalidValue) as info:
        ServedRollout((1, 2), (-0.1, -0.2), "stop", Usage(3, 5))
    assert info.value.field == "usage.completion_tokens"


def test_result_from_served_keeps_everything_and_truncated_means_length():
    result = RolloutResult.from_served("r9", ServedRollout((4,), (-1.0,), "length", Usage(2, 1),
                                                           weight_version=3), attempts=2)
    assert (result.request_id, result.token_ids, result.logprobs) == ("r9", (4,), (-1.0,))
    assert result.truncated and result.weight_version == 3 and result.attempts == 2
    assert not RolloutResult.from_served("r", served()).truncated


def test_result_from_served_sets_every_field_and_refuses_a_bad_attempt_count():
    import attrs

    result = RolloutResult.from_served("r", served(), attempts=3)
    assert {f.name for f in attrs.fields(RolloutResult)} <= set(attrs.asdict(result))
    with pytest.raises(InvalidValue) as refused:
        RolloutResult.from_served("r", served(), attempts=0)
    assert refused.value.field == "attempts"


@pytest.mark.parametrize("runs", [None, ((4, 2),), ((4, 1), (4, 1)), ((4, 1), (5, 1))])
def test_a_decoded_rollout_equals_the_checked_one(runs):
    extra = {} if runs is None else {"weight_versions": runs}
    checked = ServedRollout((1, 2), (-0.1, -0.2), FinishReason.STOP, Usage(3, 2),
                            routed_experts=[[1]], weight_version=4, **extra)
    decoded = ServedRollout.from_decoded((1, 2), (-0.1, -0.2), FinishReason.STOP, 3,
                                         routed_experts=[[1]], weight_version=4, weight_versions=runs)
    assert decoded == checked


@pytest.mark.parametrize("logprobs, runs, field", [
    ((-0.1,), None, "logprobs"),
    ((-0.1, -0.2), ((4, 1),), "weight_versions"),
    ((-0.1, -0.2), ((4, 0), (5, 2)), "weight_versions[0][1]"),
])
def test_a_decoded_rollout_still_checks_across_its_fields(logprobs, runs, field):
    with pytest.raises(InvalidValue) as info:
        ServedRollout.from_decoded((1, 2), logprobs, FinishReason.STOP, 3, weight_versions=runs)
    assert info.value.field == field
