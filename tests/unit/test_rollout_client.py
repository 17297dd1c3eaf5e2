"""The core's rollout client against the in-memory transport (faults queued on it)."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import EngineCompletionsTransport, MemoryEngine
from rollout_fleet.core.budget import ContextLimitPolicy
from rollout_fleet.core.clock import Clock
from rollout_fleet.core.errors import (
    ContextLimitExceeded, HttpStatusError, InvalidValue, LengthMismatch, RetriesExhausted,
    TransportError,
)
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.rollout import FinishReason, SamplingSpec
from rollout_fleet.core.rollout_client import RolloutClient, RolloutLimits
from rollout_fleet.ports.completions import TransportResponse
from rollout_fleet.ports.contracts.completions import CompletionsContract, CompletionsUnderTest
from rollout_fleet.core.loop_thread import LoopThread

LIMITS = RolloutLimits(max_model_len=64, max_new_tokens=10)


class RecordingClock(Clock):
    def __init__(self):
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return sum(self.slept)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def client_over(faults=(), retry=RetryPolicy(max_attempts=4, base_delay_s=0.1, jitter=0.0)):
    engine = MemoryEngine(seed=0)
    transport = EngineCompletionsTransport(engine, faults=faults)
    clock = RecordingClock()
    return RolloutClient(transport, model="memory", retry=retry, clock=clock), transport, clock, engine


def run(client, request):
    return asyncio.run(client.rollout(request))


def test_result_equals_the_engines_own_answer():
    client, _, clock, engine = client_over()
    request = LIMITS.request("r1", [3, 4], sampling=SamplingSpec(greedy=False, seed=5),
                             stop_strings=["th"])
    result = run(client, request)
    direct = asyncio.run(engine.serve_rollout([3, 4], request_id="d", max_new_tokens=10,
                                              sampling=request.sampling, stop_strings=["th"]))
    assert (result.token_ids, result.logprobs, result.finish_reason) == (
        direct.token_ids, direct.logprobs, direct.finish_reason)
    assert result.attempts == 1 and clock.slept == []


def test_transient_failures_are_retried_with_backoff_and_one_request_id():
    faults = [TransportResponse(503, b"busy"), TransportError("reset"),
              TransportResponse(429, b"", retry_after_s=0.3)]
    client, transport, clock, _ = client_over(faults)
    result = run(client, LIMITS.request("same-id", [3], sampling=SamplingSpec()))
    assert result.attempts == 4
    assert clock.slept == pytest.approx([0.1, 0.2, 0.4])
    assert transport.seen_request_ids == ["same-id"] * 4
    # Each attempt sent again is counted under the cause of the one that failed.
    assert client.retried == {"http 503": 1, "TransportError": 1, "http 429": 1}


def test_a_corrupted_body_is_retried():
    client, _, _, _ = client_over([TransportResponse(200, b'{"choices": [{"te')])
    assert run(client, LIMITS.request("c", [3], sampling=SamplingSpec())).attempts == 2


def test_a_4xx_is_not_retried():
    client, transport, clock, _ = client_over([TransportResponse(400, b"bad prompt")])
    with pytest.raises(HttpStatusError) as info:
        run(client, LIMITS.request("bad", [3], sampling=SamplingSpec()))
    assert info.value.status == 400 and transport.seen_request_ids == ["bad"] and clock.slept == []
    assert client.retried == {}


def test_a_semantic_failure_is_not_retried():
    body = b'{"nvext": {"engine_data": {"v": 1, "token_ids": [1, 2], "logprobs": [-1.0],' \
           b' "finish_reason": "stop", "prompt_tokens": 1}}}'
    client, transport, _, _ = client_over([TransportResponse(200, body)])
    with pytest.raises(LengthMismatch):
        run(client, LIMITS.request("m", [3], sampling=SamplingSpec()))
    assert len(transport.seen_request_ids) == 1


def test_exhaustion_names_the_attempts_and_the_last_status():
    client, transport, _, _ = client_over([TransportResponse(503, b"busy")] * 4)
    with pytest.raises(RetriesExhausted) as info:
        run(client, LIMITS.request("x", [3], sampling=SamplingSpec()))
    assert info.value.attempts == 4 and "HTTP 503" in str(info.value) and "'x'" in str(info.value)
    assert len(transport.seen_request_ids) == 4


def test_context_limit_policies():
    with pytest.raises(ContextLimitExceeded):
        LIMITS.request("long", [1] * 64, sampling=SamplingSpec())
    empty_limits = RolloutLimits(64, 10, context_limit_policy=ContextLimitPolicy.EMPTY)
    client, transport, _, _ = client_over()
    result = run(client, empty_limits.request("long", [1] * 64, sampling=SamplingSpec()))
    assert result.token_ids == () and result.finish_reason is FinishReason.LENGTH and result.truncated
    assert transport.seen_request_ids == []  # nothing was sent


def test_budget_is_fitted_to_the_context():
    request = LIMITS.request("fit", [1] * 60, sampling=SamplingSpec())
    assert request.max_new_tokens == 4


@pytest.fixture(scope="class")
def completions_under_test():
    loop = LoopThread()
    engine = MemoryEngine(0)
    yield CompletionsUnderTest(EngineCompletionsTransport(engine), loop, "memory", [3, 4],
                               refused_prompt=[3, 999], kill_engine=engine.die)
    loop.close()


class TestEngineCompletionsTransport(CompletionsContract):
    pass


def test_a_request_from_a_checked_prompt_equals_the_fully_checked_one_and_checks_the_rest():
    """A batch's prompts are checked once by tensor ops (adapters/nemo_rl/batch.py); the request
    then skips only that check: every other field is still refused by name."""
    limits = RolloutLimits(max_model_len=64, max_new_tokens=10, stop_strings=("\n",),
                           stop_token_ids=(2,))
    sampling = SamplingSpec(greedy=False, temperature=0.7, seed=3)
    fields = {"sampling": sampling, "stop_strings": ["END"], "logprobs": False}
    full = limits.request("r-1", [5, 6, 7], **fields)
    assert limits.request("r-1", [5, 6, 7], prompt_checked=True, **fields) == full
    assert full.stop_strings == ("\n", "END") and full.stop_token_ids == (2,)
    with pytest.raises(InvalidValue, match="stop_strings"):
        limits.request("r-2", [5], sampling=sampling, stop_strings=["x", ""], prompt_checked=True)
    with pytest.raises(InvalidValue, match="request_id"):
        limits.request("", [5], sampling=sampling, prompt_checked=True)
    with pytest.raises(InvalidValue, match="sampling"):
        limits.request("r-3", [5], sampling="greedy", prompt_checked=True)  # type: ignore[arg-type]
