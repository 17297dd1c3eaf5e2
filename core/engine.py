"""The engine port: the backend seam. A new backend implements its four abstract methods.

Declared in core, beside the worker's rollout service written against it (the core may not
import ports); ``rollout_fleet.ports`` exports it with the other ports. A backend never imports
Dynamo or HTTP code: the Dynamo adapter serves any EnginePort.
"""

from __future__ import annotations

import asyncio
import inspect
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout, sample_sampling
from rollout_fleet.core.sampling import NEUTRAL_SAMPLING


@attrs.frozen
class EngineFacts:
    """What a started engine can hold; registered with the serving runtime."""

    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int | None = None


@attrs.frozen(slots=True)
class RolloutPiece:
    """Tokens a streamed generation produced since its previous piece (their logprobs, and the
    top alternatives when asked); the last piece says why it ended. Built once per engine step
    by the engine, so it is checked there, not here."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None = None  # set on the last piece only
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # The last piece, where the engine tells: how many prompt tokens its prefix cache held.
    cached_prompt_tokens: int | None = None
    # The last piece, where the engine tells: the weight versions of every generated token,
    # run-length ((version, n_tokens), ...), as a whole rollout's (core/rollout.py).
    weight_versions: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def whole(cls, served: ServedRollout) -> "RolloutPiece":
        logprobs = () if served.logprobs is None else served.logprobs  # none asked for: empty
        return cls(served.token_ids, logprobs, served.finish_reason, served.top_logprobs,
                   weight_versions=served.weight_versions)


@attrs.frozen
class KvEventSource:
    """Where an engine publishes KV-cache events (for KV-aware routing)."""

    kind: str  # "zmq"
    endpoint: str  # e.g. "tcp://127.0.0.1:5557"
    topic: str = ""
    replay_endpoint: str | None = None


class EnginePort(ABC):
    """One inference engine inside one worker."""

    @abstractmethod
    async def start(self, worker_id: int | str) -> EngineFacts:
        """Bring the engine up (idempotent) and report its real limits."""

    @abstractmethod
    async def serve_rollout(
        self,
        prompt_token_ids: Sequence[int],
        *,
        request_id: str,
        max_new_tokens: int,
        sampling: SamplingSpec,
        stop_strings: Sequence[str] = (),
    ) -> ServedRollout:
        """Generate up to ``max_new_tokens`` (>= 1) tokens.

        Returns every generated token (an end-of-sequence token included, and the token that
        completed a stop string), the chosen token's logprob for each, and why it ended.
        A prompt plus budget beyond the context raises ``EngineRejected`` (an ``EngineError``:
        the request's fault); any other failure raises ``EngineError``. An aborted request
        returns what it had with finish reason ``abort``.

        Optional keywords, for OpenAI clients (see ``OPTIONAL_ROLLOUT_KEYWORDS``): an engine
        that offers them adds them to its signature, and the serving adapter passes them only
        when a request asks (an engine without them gets such requests refused for it):

        * ``top_logprobs: int`` (>= 1): also return, per generated token, that many most
          likely tokens with their logprobs (``ServedRollout.top_logprobs``);
        * ``stop_token_ids: Sequence[int]``: end at any of these tokens, which is kept as the
          last token (finish reason ``stop``), as an end-of-sequence token is;
        * ``extra_sampling: Mapping[str, Any]``: non-neutral values of the options the engine
          declares in ``sampling_offered`` (names and meanings: ``core.sampling``, vLLM's);
        * ``with_logprobs: bool``: passed False for a rollout that asked for no logprobs (a
          trainer that recomputes them): the engine computes none and answers ``logprobs``
          None; the tokens stay the same. An engine without it computes them, and the worker
          drops them from the answer.
        """

    async def serve_group(self, prompt_token_ids: Sequence[int], *, request_id: str, n: int,
                          max_new_tokens: int, sampling: SamplingSpec,
                          stop_strings: Sequence[str] = (), **keywords: Any
                          ) -> tuple[ServedRollout, ...]:
        """``n`` samples of one prompt, in sample order: sample i is what ``serve_rollout``
        answers with ``sample_sampling(sampling, i)`` (its own seed), with its own logprobs
        and weight versions. By default n rollouts at once, ids ``request_id/i``; an engine
        that can share the prompt's prefill among them (vLLM's ``n``) overrides it. Takes
        ``serve_rollout``'s optional keywords; the same errors."""
        return tuple(await asyncio.gather(*(
            self.serve_rollout(prompt_token_ids, request_id=f"{request_id}/{index}",
                               max_new_tokens=max_new_tokens,
                               sampling=sample_sampling(sampling, index),
                               stop_strings=stop_strings, **keywords)
            for index in range(n))))

    def sampling_offered(self) -> frozenset[str]:
        """The options of ``core.sampling.NEUTRAL_SAMPLING`` this engine honours (passed in
        ``extra_sampling``); none by default. Neutral values never reach the engine."""
        return frozenset()

    async def stream_rollout(self, prompt_token_ids: Sequence[int], *, request_id: str,
                             max_new_tokens: int, sampling: SamplingSpec,
                             stop_strings: Sequence[str] = (), with_logprobs: bool = True,
                             **keywords: Any) -> AsyncIterator[RolloutPiece]:
        """``serve_rollout`` as it generates: pieces whose tokens, joined, are what it returns
        (same keywords, same errors). By default one piece, the whole answer; an engine that
        can hand out tokens as they come overrides it.

        ``with_logprobs=False``: the caller reads no logprobs (an OpenAI request that did not
        ask for them), so an engine may skip computing them and leave every piece's
        ``logprobs`` empty; the tokens stay the same. An override that omits the keyword is
        never passed it (``streams_without_logprobs``)."""
        served = await self.serve_rollout(prompt_token_ids, request_id=request_id,
                                          max_new_tokens=max_new_tokens, sampling=sampling,
                                          stop_strings=stop_strings, **keywords)
        yield RolloutPiece.whole(served)

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Cancel ``request_id``: in flight, or still to come; an unknown id is a no-op."""

    @abstractmethod
    def kv_event_sources(self) -> Sequence[KvEventSource]:
        """Where this engine publishes KV events; empty when it does not."""

    def kv_cache_usage(self) -> float | None:
        """The fraction of KV-cache blocks in use now (0..1), for load reports; None when the
        engine does not know it."""
        return None

    def dead_reason(self) -> str | None:
        """Why this engine can never serve again (its process died), or None while it can. The
        worker polls it and leaves the fleet's routing when it says so. None by default."""
        return None

    def progress(self) -> int | None:
        """A count that grows each time the engine completes a step (a token of any request);
        None when the engine does not count. The worker's hang watchdog reads it: a busy engine
        whose count stands still for ``hang_timeout_s`` is hung. None by default (not watched)."""
        return None

    async def close(self) -> None:
        """Release what the engine holds (processes, memory) now; the worker calls it once,
        when it stops. Nothing to do by default."""


OPTIONAL_ROLLOUT_KEYWORDS = ("top_logprobs", "stop_token_ids", "with_logprobs")
SAMPLING_OPTIONS = tuple(NEUTRAL_SAMPLING)


def streams_without_logprobs(engine: EnginePort) -> bool:
    """Whether this engine's ``stream_rollout`` takes ``with_logprobs``."""
    return "with_logprobs" in inspect.signature(engine.stream_rollout).parameters


def offered_keywords(engine: EnginePort) -> frozenset[str]:
    """The optional ``serve_rollout`` keywords this engine's signature takes."""
    parameters = inspect.signature(engine.serve_rollout).parameters
    return frozenset(name for name in OPTIONAL_ROLLOUT_KEYWORDS if name in parameters)
