import pytest

from rollout_fleet.core.errors import (
    ErrorInBody, HttpStatusError, InvalidValue, LengthMismatch, TransportError, UnreadableBody,
)
from rollout_fleet.core.retry import RetryPolicy, is_transient


@pytest.mark.parametrize("error, transient", [
    (TransportError("reset"), True),
    (UnreadableBody("cut"), True),
    (HttpStatusError(408), True),
    (HttpStatusError(429), True),
    (HttpStatusError(499), True),  # cancelled by the server: the reading client did not close it
    (HttpStatusError(500), True),
    (HttpStatusError(503), True),
    (HttpStatusError(599), True),
    (HttpStatusError(400), False),
    (HttpStatusError(404), False),
    (HttpStatusError(422), False),
    (ErrorInBody("no"), False),
    (LengthMismatch("no"), False),
    (ValueError("not ours"), False),
])
def test_transient_outcomes(error, transient):
    assert is_transient(error) is transient


def test_delays_grow_by_backoff_and_cap():
    policy = RetryPolicy(max_attempts=10, base_delay_s=0.1, backoff=2.0, max_delay_s=0.5, jitter=0.0)
    assert [policy.delay_s(n, 0.3) for n in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_jitter_spans_the_stated_band():
    policy = RetryPolicy(base_delay_s=1.0, jitter=0.25, max_delay_s=10)
    assert policy.delay_s(1, 0.0) == pytest.approx(0.75)
    assert policy.delay_s(1, 0.5) == pytest.approx(1.0)
    assert policy.delay_s(1, 0.999999) == pytest.approx(1.25, abs=1e-5)


def test_retry_after_is_a_floor_capped_by_max_delay():
    policy = RetryPolicy(base_delay_s=0.1, jitter=0.0, max_delay_s=2.0)
    assert policy.delay_s(1, 0.5, retry_after_s=1.5) == pytest.approx(1.5)
    assert policy.delay_s(1, 0.5, retry_after_s=30) == pytest.approx(2.0)
    assert policy.delay_s(1, 0.5, retry_after_s=0.01) == pytest.approx(0.1)


def test_should_retry_respects_attempts_and_kind():
    policy = RetryPolicy(max_attempts=3)
    assert policy.should_retry(1, HttpStatusError(503))
    assert policy.should_retry(2, HttpStatusError(503))
    assert not policy.should_retry(3, HttpStatusError(503))
    assert not policy.should_retry(1, HttpStatusError(400))


@pytest.mark.parametrize("kwargs, field", [
    ({"max_attempts": 0}, "retry.max_attempts"), ({"base_delay_s": -1}, "retry.base_delay_s"),
    ({"backoff": 0.5}, "retry.backoff"), ({"jitter": 2}, "retry.jitter"),
])
def test_bad_policies(kwargs, field):
    with pytest.raises(InvalidValue) as info:
        RetryPolicy(**kwargs)
    assert info.value.field == field
