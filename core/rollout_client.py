"""The rollout client: build the wire body, send with retries, parse, return a RolloutResult."""

from __future__ import annotations

import collections
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.budget import ContextLimitPolicy, token_budget
from rollout_fleet.core.clock import Clock, SystemClock
from rollout_fleet.core.errors import (
    HttpStatusError,
    MissingField,
    RetriesExhausted,
    RolloutFleetError,
)
from rollout_fleet.core.retry import RetryPolicy, is_transient
from rollout_fleet.core.rollout import (
    FinishReason,
    RolloutRequest,
    RolloutResult,
    SamplingSpec,
    ServedRollout,
    as_stop_token_ids,
    check_rollout_fields,
)
from rollout_fleet.core.partial import continuation_request, join_rollouts
from rollout_fleet.core.stop_strings import merge_stop_strings
from rollout_fleet.core.wire import completion_body, parse_completion_answer, parse_group_answer

# How many rollouts one driver keeps in flight by default: the fleet config's, the generation
# config's and the HTTP pool's ``max_in_flight`` (the pool holds that many connections).
DEFAULT_MAX_IN_FLIGHT = 1024


@attrs.frozen
class RolloutLimits:
    """The fleet-wide rules every request is fitted to before it leaves the driver."""

    max_model_len: int
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    context_limit_policy: ContextLimitPolicy = ContextLimitPolicy.REJECT
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=as_stop_token_ids)

    def request(self, request_id: str, prompt_token_ids: Sequence[int], *,
                sampling: SamplingSpec, stop_strings: Sequence[str] | None = None,
                max_new_tokens: int | None = None, logprobs: bool = True,
                prompt_checked: bool = False) -> RolloutRequest:
        """A validated request: budget fitted to the context, stop strings merged.
        ``prompt_checked``: the prompt is a non-empty list of ints >= 0, checked where it
        entered (a batch's tensor check); it is not checked again, every other field is (the
        stop strings as they are merged, the stop IDs when these limits were made)."""
        budget = token_budget(len(prompt_token_ids),
                              self.max_new_tokens if max_new_tokens is None else max_new_tokens,
                              self.max_model_len, self.context_limit_policy)
        stops = (merge_stop_strings(self.stop_strings, stop_strings)
                 if self.stop_strings or stop_strings is not None else ())
        if not prompt_checked:
            return RolloutRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                  max_new_tokens=budget, sampling=sampling, stop_strings=stops,
                                  stop_token_ids=self.stop_token_ids, logprobs=logprobs)
        check_rollout_fields(request_id, budget, sampling, 1, False, logprobs)
        return RolloutRequest.from_checked(
            tuple(prompt_token_ids), request_id=request_id, max_new_tokens=budget,
            sampling=sampling, stop_strings=stops, stop_token_ids=self.stop_token_ids, n=1,
            ignore_eos=False, logprobs=logprobs)


@attrs.frozen
class TransportResponse:
    status: int
    body: bytes
    retry_after_s: float | None = None  # the server's Retry-After, when it sent one


class CompletionsTransport(ABC):
    """The completions port: the driver's one way to reach the frontend. Declared here, beside
    the client written against it (``rollout_fleet.ports`` exports it with the other ports).

    POSTs a completion body; raises ``TransportError`` when no HTTP answer came."""

    @abstractmethod
    async def post_completion(self, body: Mapping[str, Any], *, request_id: str) -> TransportResponse:
        """Send ``body`` to ``/v1/completions`` with ``request_id`` as a header (same on every attempt)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release connections; safe to call twice."""

    def read_answer(self, body: bytes) -> ServedRollout:
        """The served rollout in a 2xx answer's ``body``: ``core.wire.parse_completion_answer``.
        A transport with a faster decoder of its own wire overrides this; it must give the
        same value, or raise the same error."""
        return parse_completion_answer(body)


def _cause(error: BaseException) -> str:
    """A retried attempt's cause, coarse enough to count: the HTTP status, else the error's type."""
    status = getattr(error, "status", None)
    return f"http {status}" if isinstance(status, int) else type(error).__name__


def _no_logprobs(request: RolloutRequest) -> tuple[()] | None:
    """The logprobs of an answer with no token: none, or None when none were asked for."""
    return () if request.logprobs else None


def _check_logprobs(request: RolloutRequest, served: ServedRollout) -> None:
    if request.logprobs and served.logprobs is None:
        raise MissingField(f"nvext.engine_data.logprobs (rollout {request.request_id!r} asked "
                           "for them; the worker answered none)")


class RolloutClient:
    """Sends rollouts through a CompletionsTransport, retrying transient failures.

    Every attempt of one rollout carries the same request id, so a server (or a log reader)
    can tell retries from new work.
    """

    def __init__(self, transport: CompletionsTransport, *, model: str, retry: RetryPolicy | None = None,
                 clock: Clock | None = None, rng: random.Random | None = None) -> None:
        self._transport = transport
        self._model = model
        self._retry = retry or RetryPolicy()
        self._clock = clock or SystemClock()
        self._rng = rng or random.Random()
        # Attempts sent again, by the cause of the one that failed: a retry re-runs work a
        # worker may have done (its answer was lost), so a trainer can see what it costs.
        self.retried: collections.Counter[str] = collections.Counter()

    async def rollout(self, request: RolloutRequest) -> RolloutResult:
        if request.max_new_tokens == 0:  # the "empty" context-limit policy: nothing to generate
            return RolloutResult(request.request_id, (), _no_logprobs(request), FinishReason.LENGTH,
                                 attempts=0)
        served, attempts = await self._send(request, self._transport.read_answer)
        _check_logprobs(request, served)
        return RolloutResult.from_served(request.request_id, served, attempts=attempts)

    async def rollout_group(self, request: RolloutRequest) -> tuple[RolloutResult, ...]:
        """The ``request.n`` samples of a group, in sample order, from one request (one worker;
        retried whole). Sample i's request id is ``<request_id>/<i>``."""
        ids = [f"{request.request_id}/{index}" for index in range(request.n)]
        if request.max_new_tokens == 0:
            return tuple(RolloutResult(i, (), _no_logprobs(request), FinishReason.LENGTH,
                                       attempts=0) for i in ids)
        samples, attempts = await self._send(
            request, lambda body: parse_group_answer(body, request.n))
        for served in samples:
            _check_logprobs(request, served)
        return tuple(RolloutResult.from_served(i, served, attempts=attempts)
                     for i, served in zip(ids, samples))

    async def results(self, request: RolloutRequest) -> tuple[RolloutResult, ...]:
        """Every result of ``request``: a group's n samples, else its one rollout."""
        if request.n > 1:
            return await self.rollout_group(request)
        return (await self.rollout(request),)

    async def _send(self, request: RolloutRequest, read: Any) -> tuple[Any, int]:
        """(what ``read`` makes of the 2xx answer, the attempts it took)."""
        body = completion_body(request, self._model)
        attempt = 0
        while True:
            attempt += 1
            retry_after = None
            try:
                response = await self._transport.post_completion(body, request_id=request.request_id)
                retry_after = response.retry_after_s
                if not 200 <= response.status < 300:
                    raise HttpStatusError(response.status, response.body[:2000])
                return read(response.body), attempt
            except RolloutFleetError as error:
                if self._retry.should_retry(attempt, error):
                    self.retried[_cause(error)] += 1
                    await self._clock.sleep(self._retry.delay_s(attempt, self._rng.random(), retry_after))
                    continue
                if attempt == 1 and not is_transient(error):
                    raise  # a permanent failure on the first try: the error itself is clearest
                raise RetriesExhausted(request.request_id, attempt, error) from error

    async def continue_rollout(self, request: RolloutRequest, partial: RolloutResult,
                               request_id: str | None = None) -> RolloutResult:
        """Generate the rest of ``request`` after ``partial`` (its aborted answer) and join the
        two: token IDs, logprobs and per-token weight versions as if it had never been cut."""
        rest = await self.rollout(continuation_request(request, partial, request_id))
        return join_rollouts(partial, rest)
