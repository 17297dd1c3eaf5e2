"""The HTTP adapter against a real loopback HTTP server (a real hop, faults injected there)."""

from __future__ import annotations

import asyncio
import pickle
import random
import time

import pytest

from rollout_fleet.adapters.http import (
    CLIENT_KINDS, ClientKind, HttpCompletionsTransport, HttpSettings, LoopClients, parse_retry_after,
)
from rollout_fleet.core.clock import Clock
from rollout_fleet.core.errors import (
    HttpStatusError, InvalidValue, RetriesExhausted, TransportError,
)
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.rollout_client import RolloutClient
from rollout_fleet.core.validate import Vocabulary
from rollout_fleet.ports.contracts.completions import CompletionsContract, CompletionsUnderTest
from rollout_fleet.core.loop_thread import LoopThread
from tests.http.loopback_frontend import MODEL, Fault, LoopbackFrontend

POLICY = RetryPolicy(max_attempts=4, base_delay_s=0.1, backoff=2.0, max_delay_s=5.0, jitter=0.0)


class RecordingClock(Clock):
    """Records the delays the rollout client asks for instead of sleeping them."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return sum(self.slept)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


@pytest.fixture(scope="module")
def frontend():
    server = LoopbackFrontend()
    yield server
    server.close()


@pytest.fixture
def fresh_frontend(frontend):
    frontend.faults.clear()
    frontend.attempt_ids.clear()
    return frontend


def engine_answer(frontend, prompt, budget):
    """What the in-memory engine itself answers (greedy is deterministic)."""
    return asyncio.run(frontend.engine.serve_rollout(prompt, request_id="direct",
                                                     max_new_tokens=budget,
                                                     sampling=RolloutRequest("x", [1], 1).sampling))


def rollout(transport, request, clock=None, policy=POLICY):
    async def go():
        client = RolloutClient(transport, model=MODEL, retry=policy, clock=clock or RecordingClock(),
                               rng=random.Random(0))
        try:
            return await client.rollout(request)
        finally:
            await transport.aclose()
    return asyncio.run(go())


# -- the port's contract, for every client stack ------------------------------------------------
@pytest.fixture(scope="module", params=CLIENT_KINDS)
def completions_under_test(request):
    server = LoopbackFrontend()  # its own: the contract's last test kills its engine
    loop = LoopThread()
    transport = HttpCompletionsTransport(server.url, HttpSettings(client=request.param))
    yield CompletionsUnderTest(transport, loop, MODEL, prompt=[3, 4, 5], refused_prompt=[3, 999],
                               kill_engine=server.engine.die)
    loop.run(transport.aclose())
    loop.close()
    server.close()


class TestHttpCompletionsContract(CompletionsContract):
    pass


# -- retries over a real hop --------------------------------------------------------------------
@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_503_then_success_is_retried_with_the_same_request_id(fresh_frontend, kind):
    fresh_frontend.faults.append(Fault(503))
    transport = HttpCompletionsTransport(fresh_frontend.url, HttpSettings(client=kind))
    clock = RecordingClock()
    result = rollout(transport, RolloutRequest("r-503", [3, 4, 5], 6), clock)
    assert result.attempts == 2
    assert clock.slept == [POLICY.delay_s(1, 0.0)]
    assert fresh_frontend.attempt_ids == ["r-503", "r-503"]
    expected = engine_answer(fresh_frontend, [3, 4, 5], 6)
    assert result.token_ids == expected.token_ids and result.logprobs == expected.logprobs


def test_429_and_connection_resets_are_retried_with_the_policy_delays(fresh_frontend):
    fresh_frontend.faults.extend([Fault(429), Fault.connection_reset(),
                                  Fault(429, {"Retry-After": "1.5"})])
    transport = HttpCompletionsTransport(fresh_frontend.url)
    clock = RecordingClock()
    result = rollout(transport, RolloutRequest("r-429", [7, 8], 5), clock)
    assert result.attempts == 4
    # attempt 1: 0.1 s; attempt 2 (reset): 0.2 s; attempt 3: Retry-After 1.5 s beats 0.4 s
    assert clock.slept == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(1.5)]
    assert fresh_frontend.attempt_ids == ["r-429"] * 4


def test_400_is_not_retried_and_says_why(fresh_frontend):
    transport = HttpCompletionsTransport(fresh_frontend.url)
    clock = RecordingClock()
    bad = RolloutRequest("r-400", [3, 999], 4)  # 999 is outside the engine's vocabulary
    with pytest.raises(HttpStatusError) as caught:
        rollout(transport, bad, clock)
    assert caught.value.status == 400
    assert "vocabulary" in str(caught.value)
    assert fresh_frontend.attempt_ids == ["r-400"]
    assert clock.slept == []


def test_exhaustion_names_the_attempts_and_the_last_status(fresh_frontend):
    fresh_frontend.faults.extend([Fault(503), Fault(502), Fault(503), Fault(504)])
    transport = HttpCompletionsTransport(fresh_frontend.url)
    with pytest.raises(RetriesExhausted) as caught:
        rollout(transport, RolloutRequest("r-gone", [3], 4))
    assert caught.value.attempts == 4
    assert isinstance(caught.value.last_error, HttpStatusError)
    assert caught.value.last_error.status == 504
    assert "4 attempt(s)" in str(caught.value) and "HTTP 504" in str(caught.value)
    assert fresh_frontend.attempt_ids == ["r-gone"] * 4


def test_a_refused_connection_is_a_transport_error_and_is_retried():
    with socket_closed_port() as port:
        transport = HttpCompletionsTransport(f"http://127.0.0.1:{port}")
        clock = RecordingClock()
        with pytest.raises(RetriesExhausted) as caught:
            rollout(transport, RolloutRequest("r-refused", [3], 2), clock)
    assert isinstance(caught.value.last_error, TransportError)
    assert f"127.0.0.1:{port}" in str(caught.value.last_error)
    assert len(clock.slept) == POLICY.max_attempts - 1


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_a_read_timeout_is_a_transport_error(kind):
    slow = LoopbackFrontend(delay_s=1.0)
    try:
        transport = HttpCompletionsTransport(slow.url, HttpSettings(read_timeout_s=0.2, client=kind))
        with pytest.raises(RetriesExhausted) as caught:
            rollout(transport, RolloutRequest("r-slow", [3], 2),
                    policy=RetryPolicy(max_attempts=2, jitter=0.0))
        assert isinstance(caught.value.last_error, TransportError)
        assert slow.attempt_ids == ["r-slow", "r-slow"]
    finally:
        slow.close()


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_an_attempt_past_its_request_timeout_is_a_transport_error(kind):
    slow = LoopbackFrontend(delay_s=1.0)  # well within the read timeout, past the request's
    try:
        settings = HttpSettings(read_timeout_s=30.0, request_timeout_s=0.2, client=kind)
        transport = HttpCompletionsTransport(slow.url, settings)
        with pytest.raises(RetriesExhausted) as caught:
            rollout(transport, RolloutRequest("r-deadline", [3], 2),
                    policy=RetryPolicy(max_attempts=2, jitter=0.0))
        assert isinstance(caught.value.last_error, TransportError)
        # The client gave up on the second attempt after 0.2 s: on a loaded machine the server's
        # thread may log its arrival later than that.
        _wait_for(lambda: len(slow.attempt_ids) >= 2, timeout_s=30.0)
        assert slow.attempt_ids == ["r-deadline", "r-deadline"]
    finally:
        slow.close()


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_an_attempt_that_hangs_is_sent_again_after_its_budgets_bound_and_comes_back_once(
        fresh_frontend, kind):
    fresh_frontend.faults.append(Fault(hang=True))
    # The first attempt is given up after its bound (fixed + per token), not request_timeout_s.
    settings = HttpSettings(client=kind, read_timeout_s=600.0, request_timeout_s=600.0,
                            attempt_fixed_s=0.5, attempt_per_token_s=0.01)
    transport = HttpCompletionsTransport(fresh_frontend.url, settings)
    result = rollout(transport, RolloutRequest("r-hang", [3, 4, 5], 6))
    assert result.attempts == 2
    assert fresh_frontend.attempt_ids == ["r-hang", "r-hang"]
    expected = engine_answer(fresh_frontend, [3, 4, 5], 6)
    assert result.token_ids == expected.token_ids and result.logprobs == expected.logprobs


# -- one pool, sized from the configured in-flight rollouts -------------------------------------
@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_1000_concurrent_rollouts_through_one_client_stay_within_the_socket_limit(kind):
    server = LoopbackFrontend(delay_s=0.02)  # slow: every connection of the pool is taken
    settings = HttpSettings(max_in_flight=24, extra_connections=0, client=kind)
    transport = HttpCompletionsTransport(server.url, settings)
    prompts = [[(i % 40) + 1, (i * 7) % 40 + 1] for i in range(1000)]

    async def go():
        client = RolloutClient(transport, model=MODEL, retry=POLICY, clock=RecordingClock())
        try:
            return await asyncio.gather(*(
                client.rollout(RolloutRequest(f"many-{i}", p, 8)) for i, p in enumerate(prompts)))
        finally:
            await transport.aclose()
    try:
        results = asyncio.run(go())
        assert [r.request_id for r in results] == [f"many-{i}" for i in range(1000)]
        assert all(r.attempts == 1 for r in results)
        for i in (0, 1, 500, 999):
            assert results[i].token_ids == engine_answer(server, prompts[i], 8).token_ids
        assert len(server.attempt_ids) == 1000
        assert server.peak_active == settings.max_in_flight
        assert len(server.peers) == settings.max_in_flight
    finally:
        server.close()


def test_one_client_per_event_loop_and_a_pickled_copy_builds_its_own(frontend):
    clients = LoopClients(HttpSettings())

    async def two_lookups():
        return clients.current(), clients.current()
    first, again = asyncio.run(two_lookups())
    assert first is again
    other, _ = asyncio.run(two_lookups())
    assert other is not first

    transport = HttpCompletionsTransport(frontend.url, HttpSettings(max_in_flight=7))
    copy = pickle.loads(pickle.dumps(transport))
    assert copy.url == transport.url and copy.settings == transport.settings
    assert copy.clients is not transport.clients and copy.clients.loops_with_a_client == 0
    result = rollout(copy, RolloutRequest("r-copy", [5, 6], 3))
    assert result.token_ids == engine_answer(frontend, [5, 6], 3).token_ids


# -- small pure parts ---------------------------------------------------------------------------
def test_retry_after_reads_seconds_and_http_dates():
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("Sun, 29 Nov 2026 10:00:30 GMT", now=1795946400.0) == 30.0
    assert parse_retry_after("Sun, 29 Nov 2026 09:59:00 GMT", now=1795946400.0) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-3") is None
    assert parse_retry_after(None) is None


@pytest.mark.parametrize("field,value", [
    ("max_in_flight", 0), ("max_in_flight", 2.5), ("connect_timeout_s", 0),
    ("read_timeout_s", float("inf")), ("request_timeout_s", 0), ("client", "urllib"),
    ("extra_connections", -1)])
def test_bad_settings_name_the_field_and_value(field, value):
    with pytest.raises(InvalidValue) as caught:
        HttpSettings(**{field: value})
    assert str(caught.value).startswith(f"http.{field}={value}")


@pytest.mark.parametrize("spelling", CLIENT_KINDS)
def test_the_client_stack_is_read_from_its_spelling_into_its_kind(spelling):
    settings = HttpSettings(client=spelling)
    assert issubclass(ClientKind, Vocabulary)
    assert settings.client is ClientKind(spelling) and settings.client == spelling
    assert f"{settings.client}" == str(settings.client) == spelling
    assert pickle.loads(pickle.dumps(settings)) == settings
    assert HttpSettings().client is ClientKind.AIOHTTP


@pytest.mark.parametrize("value", ["urllib", ["aiohttp"], None])
def test_an_unknown_client_stack_is_refused_listing_the_spellings(value):
    with pytest.raises(InvalidValue, match="must be one of aiohttp, httpx-aiohttp, httpx$"):
        HttpSettings(client=value)


def test_a_bad_frontend_url_is_refused_by_name():
    with pytest.raises(InvalidValue, match="frontend_url"):
        HttpCompletionsTransport("127.0.0.1:8000")


class socket_closed_port:
    """A loopback port with nothing listening (bound, then released)."""

    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None


def test_a_body_that_is_not_json_is_refused_by_name(frontend):
    transport = HttpCompletionsTransport(frontend.url)

    async def go():
        try:
            await transport.post_completion({"prompt": object()}, request_id="r-obj")
        finally:
            await transport.aclose()
    with pytest.raises(InvalidValue, match="body"):
        asyncio.run(go())
