"""The core converters' fast path (plain lists of ints / floats) answers exactly as the
element-by-element path: same values, same refusals naming the same element."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, strategies as st

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import logprobs_tuple, token_ids_tuple

tokens = token_ids_tuple("token_ids")
logprobs = logprobs_tuple("logprobs")
any_number = st.one_of(st.integers(-5, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                       st.booleans(), st.none(), st.text(max_size=2))


def by_element(convert, items):
    """The same converter, forced onto its slow path (a generator is not a plain sequence)."""
    return convert(iter(items))


def outcome(convert, value):
    try:
        return ("ok", convert(value))
    except InvalidValue as exc:
        return ("refused", str(exc))


@given(st.lists(any_number, max_size=8))
def test_token_fast_path_agrees_with_the_slow_path(items):
    fast, slow = outcome(tokens, items), outcome(lambda v: by_element(tokens, v), items)
    assert fast == slow == outcome(tokens, tuple(items))


@given(st.lists(any_number, max_size=8))
def test_logprob_fast_path_agrees_with_the_slow_path(items):
    fast = outcome(logprobs, items)
    slow = outcome(lambda v: by_element(logprobs, v), items)
    assert fast[0] == slow[0]
    if fast[0] == "ok":
        assert fast[1] == slow[1] and all(type(x) is float for x in fast[1])
    else:
        assert fast[1] == slow[1]


@pytest.mark.parametrize("bad,where", [([-0.5, math.nan], "logprobs[1]"), ([-1.0, 0.25], "logprobs[1]"),
                                       ([-1.0, -math.inf], "logprobs[1]"), ([True], "logprobs[0]")])
def test_logprob_refusals_still_name_the_element(bad, where):
    with pytest.raises(InvalidValue, match="^" + re.escape(where)):
        logprobs(bad)
