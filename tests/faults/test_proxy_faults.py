"""Faults injected by a real loopback proxy between the driver and the real Dynamo frontend:
503 load shedding, corrupted, truncated and reset answers. Each test checks that every sample
came back exactly once and equal to the engine's own answer, or failed with a clear error."""

from __future__ import annotations

import pytest

from rollout_fleet.core.errors import RetriesExhausted, UnreadableBody
from rollout_fleet.core.retry import RetryPolicy
from tests.driver.conftest import check_sample, engine_answers
from tests.faults.conftest import check_batch_exactly_once, collect_until_error, mixed_batch, run
from tests.faults.proxy import Corrupt, FaultProxy, Forward, Reset, Shed, Truncate

pytestmark = [pytest.mark.faults, pytest.mark.dynamo]
MAX_NEW, MAX_LEN = 16, 64
# Slack above a retry delay's upper bound: the answer's trip back, the event loop's turn, the
# next request's trip out, on 2 busy cores. The lower bound has none: a sleep is never shorter.
SCHEDULING_SLACK_S = 0.3


def sample_of(request_id: str) -> int:
    """A fresh generation numbers its rollouts 0, 1, 2... in sample order."""
    return int(request_id.rsplit("-", 1)[1])


def test_503_load_shedding_is_retried_with_backoff_and_jitter_in_the_policys_band(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.001)
    policy = RetryPolicy(max_attempts=4, base_delay_s=0.3, backoff=2.0, max_delay_s=5.0, jitter=0.5)
    floor_s = 1.0  # Retry-After on every 4th sample: a floor above the policy's own delay

    def plan(request_id: str, attempt: int):
        index = sample_of(request_id)
        if index % 4 == 0:
            return Shed(retry_after=str(floor_s)) if attempt == 1 else Forward()
        return Shed(retry_after="0") if attempt <= 2 else Forward()

    prompts, data = mixed_batch(24, seed=3, max_len=20)
    with FaultProxy(fleet.frontend.http_port, plan) as proxy:
        generation = fleet.generation(frontend_url=proxy.url, max_new_tokens=MAX_NEW,
                                      max_model_len=MAX_LEN, max_in_flight=24, retry=policy)
        try:
            pairs, error = run(collect_until_error(generation, data))
        finally:
            generation.shutdown()
    assert error is None, f"the batch failed: {error!r}"
    check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)

    seen = proxy.by_request()
    assert sorted(sample_of(r) for r in seen) == list(range(24))
    first_gaps = []
    for request_id, attempts in seen.items():
        forwarded = [a for a in attempts if isinstance(a.fault, Forward)]
        assert len(forwarded) == 1, f"{request_id} reached the frontend {len(forwarded)} times"
        gaps = [later.arrived_at - earlier.answered_at for earlier, later in zip(attempts, attempts[1:])]
        if sample_of(request_id) % 4 == 0:
            assert len(attempts) == 2
            assert floor_s <= gaps[0] <= floor_s + SCHEDULING_SLACK_S, (request_id, gaps)
            continue
        assert len(attempts) == 3, f"{request_id}: {len(attempts)} attempts"
        for attempt, gap in enumerate(gaps, start=1):
            nominal = policy.base_delay_s * policy.backoff ** (attempt - 1)
            low, high = nominal * (1 - policy.jitter), nominal * (1 + policy.jitter)
            assert low <= gap <= high + SCHEDULING_SLACK_S, (
                f"{request_id}: wait after attempt {attempt} was {gap:.3f} s; "
                f"the policy's band is [{low:.3f}, {high:.3f}] s")
        first_gaps.append(gaps[0])
    # Jitter really spreads the retries (18 draws over a 0.3 s wide band).
    assert max(first_gaps) - min(first_gaps) > 0.05, sorted(first_gaps)


def test_corrupted_truncated_and_reset_answers_are_retried_and_the_batch_completes(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.001)
    faults = {1: Corrupt(), 2: Truncate(), 3: Reset()}

    def plan(request_id: str, attempt: int):
        return faults.get(sample_of(request_id) % 4, Forward()) if attempt == 1 else Forward()

    prompts, data = mixed_batch(32, seed=4, max_len=20)
    policy = RetryPolicy(max_attempts=3, base_delay_s=0.05, jitter=0.2)
    with FaultProxy(fleet.frontend.http_port, plan) as proxy:
        generation = fleet.generation(frontend_url=proxy.url, max_new_tokens=MAX_NEW,
                                      max_model_len=MAX_LEN, max_in_flight=32, retry=policy)
        try:
            pairs, error = run(collect_until_error(generation, data))
        finally:
            generation.shutdown()
    assert error is None, f"the batch failed: {error!r}"
    check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
    for request_id, attempts in proxy.by_request().items():
        faulty = sample_of(request_id) % 4 in faults
        assert len(attempts) == (2 if faulty else 1), (request_id, [a.fault for a in attempts])


def test_a_rollout_whose_answer_is_always_corrupt_fails_clearly_and_the_driver_goes_on(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.02)
    doomed = 5  # every answer to this sample is garbage; the others are fine

    def plan(request_id: str, attempt: int):
        return Corrupt() if sample_of(request_id) == doomed else Forward()

    prompts, data = mixed_batch(16, seed=6, max_len=20)
    policy = RetryPolicy(max_attempts=3, base_delay_s=0.05, jitter=0.2)
    with FaultProxy(fleet.frontend.http_port, plan) as proxy:
        generation = fleet.generation(frontend_url=proxy.url, max_new_tokens=MAX_NEW,
                                      max_model_len=MAX_LEN, max_in_flight=16, retry=policy)
        try:
            pairs, error = run(collect_until_error(generation, data))
            # The same driver serves the next batch in full (ids continue at 16: none is doomed).
            more_prompts, more_data = mixed_batch(16, seed=7, max_len=20)
            more_pairs, more_error = run(collect_until_error(generation, more_data))
        finally:
            generation.shutdown()

    assert isinstance(error, RetriesExhausted), repr(error)
    assert isinstance(error.last_error, UnreadableBody)
    assert error.attempts == 3 and error.request_id.endswith(f"-{doomed}")
    assert f"-{doomed}' failed after 3 attempt(s)" in str(error) and "not JSON" in str(error)
    # What came before the failure is right, and nothing came twice.
    indices = [i for i, _ in pairs]
    assert doomed not in indices and len(indices) == len(set(indices))
    answers = engine_answers(prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
    for index, sample in pairs:
        check_sample(sample, prompts[index], answers[index])
    assert len(proxy.attempts_of(error.request_id)) == 3
    assert more_error is None, repr(more_error)
    check_batch_exactly_once(more_pairs, more_prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
