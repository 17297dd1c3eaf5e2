"""The sampling options beyond SamplingSpec: neutral values drop out, bad ones are named."""

import pytest

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.sampling import NEUTRAL_SAMPLING, extra_sampling


def test_neutral_and_absent_values_ask_for_nothing():
    assert extra_sampling(dict(NEUTRAL_SAMPLING)) == {}
    assert extra_sampling({name: None for name in NEUTRAL_SAMPLING}) == {}
    assert extra_sampling({"logit_bias": {}, "allowed_token_ids": []}) == {}


def test_asked_values_are_kept_and_normalised():
    asked = extra_sampling({"repetition_penalty": 1.2999999523162842, "min_tokens": 3,
                            "ignore_eos": True, "logit_bias": {"7": 5}, "min_p": 0,
                            "allowed_token_ids": (4, 5)})
    assert asked == {"repetition_penalty": 1.2999999523162842, "min_tokens": 3,
                     "ignore_eos": True, "logit_bias": {7: 5.0}, "allowed_token_ids": [4, 5]}


def test_names_outside_the_table_are_left_to_the_caller():
    assert extra_sampling({"top_k": 5, "bad_words": ["x"]}) == {}


@pytest.mark.parametrize("values, named", [
    ({"repetition_penalty": 0}, "repetition_penalty=0"),
    ({"presence_penalty": 2.5}, "presence_penalty=2.5"),
    ({"frequency_penalty": "high"}, "frequency_penalty=high"),
    ({"min_p": 1.5}, "min_p=1.5"),
    ({"min_tokens": True}, "min_tokens=True"),
    ({"ignore_eos": 1}, "ignore_eos=1"),
    ({"allowed_token_ids": [3, -1]}, r"allowed_token_ids\[1\]=-1"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias key=x"),
    ({"logit_bias": {3: 200.0}}, r"logit_bias\[3\]=200.0"),
])
def test_bad_values_are_refused_by_name(values, named):
    with pytest.raises(InvalidValue, match=named):
        extra_sampling(values)
