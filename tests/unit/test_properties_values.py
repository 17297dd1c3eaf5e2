"""Hostile input for the rollout values, token budget, stop strings and retry policy.

Any input builds a valid value or raises InvalidValue; the budget, merge and delay rules hold
for every valid input.
"""

from __future__ import annotations

import math

import attrs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_fleet.core.budget import ContextLimitPolicy, token_budget
from rollout_fleet.core.errors import (
    ContextLimitExceeded, HttpStatusError, InvalidValue, TooManyStopStrings, TransportError,
)
from rollout_fleet.core.retry import RetryPolicy, is_transient
from rollout_fleet.core.rollout import (
    FinishReason, RolloutRequest, RolloutResult, SamplingSpec, ServedRollout, Usage,
)
from rollout_fleet.core.stop_strings import merge_stop_strings
from tests.unit.hostile import HOSTILE_FLOATS, HUGE_INTS, python_values

# Hostile values biased towards the kinds each field expects.
numbers = st.integers(-3, 2**40) | HUGE_INTS | st.floats() | HOSTILE_FLOATS | st.booleans()
maybe = python_values | numbers


def _built_or_invalid(build, **kwargs):
    try:
        return build(**kwargs)
    except InvalidValue:
        return None


# ---------------------------------------------------------------- rollout values

@settings(max_examples=100)
@given(st.fixed_dictionaries({}, optional={
    "greedy": maybe, "temperature": maybe, "top_p": maybe, "top_k": maybe, "seed": maybe}))
def test_any_sampling_spec_builds_or_raises_invalid_value(kwargs):
    spec = _built_or_invalid(SamplingSpec, **kwargs)
    if spec is not None:
        assert isinstance(spec.greedy, bool)
        assert math.isfinite(spec.temperature) and spec.temperature > 0
        assert 0 < spec.top_p <= 1
        assert spec.top_k == -1 or spec.top_k >= 1
        assert spec.seed is None or 0 <= spec.seed < 2**63


@pytest.mark.parametrize("field, value", [("temperature", 10**400), ("seed", 10**5000),
                                          ("temperature", float("nan")), ("top_p", float("nan"))],
                         ids=["temperature-10e400", "seed-10e5000", "temperature-nan", "top_p-nan"])
def test_huge_or_nan_sampling_values_are_invalid_not_overflows(field, value):
    # Found by the property above: 10**400 overflowed math.isfinite, and 10**5000 has no repr.
    with pytest.raises(InvalidValue, match=field):
        SamplingSpec(**{field: value})


@settings(max_examples=100)
@given(st.fixed_dictionaries({"request_id": maybe, "prompt_token_ids": maybe, "max_new_tokens": maybe},
                             optional={"sampling": maybe, "stop_strings": maybe}))
def test_any_rollout_request_builds_or_raises_invalid_value(kwargs):
    request = _built_or_invalid(RolloutRequest, **kwargs)
    if request is not None:
        assert request.request_id and request.prompt_token_ids and request.max_new_tokens >= 0
        assert all(type(t) is int and t >= 0 for t in request.prompt_token_ids)
        assert all(isinstance(s, str) and s for s in request.stop_strings)


logprob_lists = st.lists(st.floats(max_value=0.0) | numbers, max_size=4) | maybe
id_lists = st.lists(st.integers(-1, 9) | numbers, max_size=4) | maybe


@settings(max_examples=120)
@given(id_lists, logprob_lists, maybe | st.sampled_from(FinishReason), maybe, maybe, maybe)
def test_any_served_rollout_builds_or_raises_invalid_value(ids, logprobs, finish, prompt_tokens,
                                                           weight_version, experts):
    def build():
        usage = Usage(prompt_tokens=prompt_tokens,
                      completion_tokens=len(ids) if isinstance(ids, list) else ids)
        return ServedRollout(ids, logprobs, finish, usage, experts, weight_version)

    served = _built_or_invalid(build)
    if served is not None:
        assert len(served.token_ids) == len(served.logprobs) == served.usage.completion_tokens
        assert all(math.isfinite(lp) and lp <= 0 for lp in served.logprobs)
        assert isinstance(served.finish_reason, FinishReason)
        result = RolloutResult.from_served("r", served)
        assert (result.token_ids, result.logprobs) == (served.token_ids, served.logprobs)
        # Taken without a second check, it equals what the checked constructor builds.
        checked = RolloutResult("r", served.token_ids, served.logprobs, served.finish_reason,
                                served.routed_experts, served.weight_version, 1,
                                served.weight_versions)
        assert result == checked and attrs.asdict(result) == attrs.asdict(checked)


@given(maybe)
def test_any_finish_reason_parses_or_raises_invalid_value(value):
    reason = _built_or_invalid(FinishReason.parse, value=value)
    assert reason is None or reason.value == value


# ---------------------------------------------------------------- budget and stop strings

@settings(max_examples=120)
@given(numbers | maybe, numbers | maybe, numbers | maybe,
       maybe | st.sampled_from(ContextLimitPolicy) | st.sampled_from(["reject", "empty"]))
def test_token_budget_fits_the_context_or_raises_invalid_value(prompt_len, max_new, max_len, policy):
    try:
        budget = token_budget(prompt_len, max_new, max_len, policy)
    except ContextLimitExceeded:
        assert ContextLimitPolicy(policy) is ContextLimitPolicy.REJECT and prompt_len >= max_len
        return
    except InvalidValue:
        return
    room = max_len - prompt_len
    assert budget == (min(max_new, room) if room > 0 else 0)
    assert prompt_len + budget <= max_len or budget == 0


def test_a_huge_context_length_does_not_break_the_message():
    # Found by the property above: str(10**5000) raised ValueError while writing the message.
    with pytest.raises(ContextLimitExceeded, match="max_model_len=<unprintable int>"):
        token_budget(10**5000, 1, 10**5000)


@pytest.mark.parametrize("prompt_len", [1, 10])
def test_an_unknown_context_policy_is_refused_whatever_the_prompt(prompt_len):
    # Found by the property above: a bad policy raised a bare ValueError, or passed unseen.
    with pytest.raises(InvalidValue, match="context_limit_policy=drop"):
        token_budget(prompt_len, 4, 8, "drop")


str_groups = st.none() | st.lists(st.text(max_size=4) | maybe, max_size=40) | maybe


@settings(max_examples=120)
@given(str_groups, str_groups, st.integers(0, 40) | maybe)
def test_merge_stop_strings_unions_in_order_or_raises_invalid_value(configured, per_sample, cap):
    try:
        merged = merge_stop_strings(configured, per_sample, cap)
    except InvalidValue:
        return
    everything = [*(configured or ()), *(per_sample or ())]
    assert merged == tuple(dict.fromkeys(everything))
    assert len(merged) <= cap and all(isinstance(s, str) and s for s in merged)


@pytest.mark.parametrize("group", [5, 1.5, object(), True])
def test_a_stop_string_group_that_is_not_a_list_is_invalid(group):
    # Found by the property above: iterating an int raised TypeError.
    with pytest.raises(InvalidValue, match="stop_strings"):
        merge_stop_strings(group, None)


def test_too_many_stop_strings_after_merging():
    with pytest.raises(TooManyStopStrings):
        merge_stop_strings(["a", "b"], ["c"], cap=2)


# ---------------------------------------------------------------- retry

@settings(max_examples=100)
@given(st.fixed_dictionaries({}, optional={
    "max_attempts": maybe, "base_delay_s": maybe, "backoff": maybe, "max_delay_s": maybe, "jitter": maybe}))
def test_any_retry_policy_builds_or_raises_invalid_value(kwargs):
    policy = _built_or_invalid(RetryPolicy, **kwargs)
    if policy is not None:
        assert policy.max_attempts >= 1 and policy.backoff >= 1 and 0 <= policy.jitter <= 1
        assert math.isfinite(policy.base_delay_s) and math.isfinite(policy.max_delay_s)


finite = st.floats(min_value=0, max_value=1e6, allow_nan=False)
policies = st.builds(RetryPolicy, max_attempts=st.integers(1, 10),
                     base_delay_s=finite | st.integers(0, 100), backoff=st.floats(1, 1e3) | st.integers(1, 10),
                     max_delay_s=finite, jitter=st.floats(0, 1))
attempts = st.integers(1, 60) | st.integers(1, 10**9)
unit_randoms = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)
retry_afters = st.none() | st.floats() | st.integers(-5, 10**6)


def _nominal(policy: RetryPolicy, attempt: int) -> float:
    """min(max_delay, base * backoff**(attempt-1)), in logs so that no power overflows."""
    if policy.base_delay_s == 0:
        return 0.0
    log_delay = math.log(policy.base_delay_s) + (attempt - 1) * math.log(policy.backoff)
    return policy.max_delay_s if log_delay >= math.log(policy.max_delay_s or 1e-300) \
        else min(policy.max_delay_s, policy.base_delay_s * policy.backoff ** (attempt - 1))


@settings(max_examples=300)
@given(policies, attempts, unit_randoms, retry_afters)
def test_delay_stays_in_the_jitter_band_or_on_the_retry_after_floor(policy, attempt, unit, retry_after):
    delay = policy.delay_s(attempt, unit, retry_after)
    assert isinstance(delay, float) and 0.0 <= delay <= policy.max_delay_s
    nominal = _nominal(policy, attempt)
    low = nominal * (1 - policy.jitter)
    high = min(policy.max_delay_s, nominal * (1 + policy.jitter))
    in_band = low * (1 - 1e-9) <= delay <= high * (1 + 1e-9)
    floor = None if retry_after is None or math.isnan(retry_after) else min(retry_after, policy.max_delay_s)
    assert in_band or delay == floor
    if floor is not None:  # Retry-After is a floor, itself capped at max_delay_s
        assert delay >= floor


@settings(max_examples=100)
@given(policies.filter(lambda p: p.jitter == 0) | policies.map(
    lambda p: RetryPolicy(p.max_attempts, p.base_delay_s, p.backoff, p.max_delay_s, 0.0)),
    st.integers(1, 2000), unit_randoms)
def test_without_jitter_delays_never_shrink(policy, attempt, unit):
    assert policy.delay_s(attempt, unit) <= policy.delay_s(attempt + 1, unit) * (1 + 1e-12)


@pytest.mark.parametrize("backoff", [2, 2.0])
def test_a_late_attempt_waits_the_cap_instead_of_overflowing(backoff):
    # Found by the property above: 2.0**1999 raised OverflowError (and 2**1999 overflowed the float).
    policy = RetryPolicy(backoff=backoff, max_delay_s=5.0, jitter=0.0)
    assert policy.delay_s(2000, 0.5) == 5.0


def test_jitter_never_lifts_a_delay_past_the_cap():
    # Found by the property above: at the cap, jitter 0.2 gave up to 1.2 x max_delay_s.
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=1.0, jitter=0.2)
    assert policy.delay_s(1, 0.99) == 1.0 and policy.delay_s(1, 0.0) == pytest.approx(0.8)


@given(policies, st.integers(0, 12), st.sampled_from([TransportError("x"), HttpStatusError(503),
                                                     HttpStatusError(400), ValueError("x")]))
def test_should_retry_only_transient_errors_within_the_attempts(policy, attempt, error):
    assert policy.should_retry(attempt, error) == (attempt < policy.max_attempts and is_transient(error))
