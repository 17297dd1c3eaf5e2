"""DynamoEngineAdapter: serves any engine port through Dynamo's backend SDK (``LLMEngine``).

Two kinds of request reach ``generate``:

* a **rollout** (an ``nvext.annotations`` entry ``rollout:<spec>``): served by the engine's
  ``serve_rollout`` and answered as ONE final chunk whose ``engine_data`` carries the whole
  result (token IDs and logprobs together), so the client reads it from ``nvext.engine_data``;
* a **plain** completion (no annotation we know): served as an ordinary OpenAI completion
  from the engine's ``stream_rollout``, a chunk per piece as the engine hands it over (with
  per-token logprobs when asked), so any OpenAI client works against the fleet, streaming
  included. One choice per request: Dynamo 1.6.1's frontend ends an answer at the first
  choice that finishes, so ``n > 1`` is refused. Neutral sampling values are accepted; an
  option the engine cannot honour is refused with a 400 that names it, never silently ignored.

The request kinds are a table keyed by annotation prefix: a new kind is one entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from dynamo.common.backend import (
    EngineConfig,
    GenerateChunk,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.publisher import ZmqSource
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown
from rollout_fleet.adapters.dynamo.controls import (
    CONTROL_SECRET_FIELD, ControlHandler, ServingLedger, WorkerControls,
)
from rollout_fleet.adapters.dynamo.plain import GeneratedTurn, piece_chunks, PlainOptions, TokenTexts
from rollout_fleet.adapters.dynamo.worker_metrics import register_worker_metrics
from rollout_fleet.adapters.shared.streams import closed_on_exit
from rollout_fleet.core.control_relay import PeerControls
from rollout_fleet.core.errors import (
    AnnotationError, EngineAsleep, EngineDead, EngineRejected, InvalidValue,
)
from rollout_fleet.core.validate import check_int_at_least
from rollout_fleet.core.rollout import FinishReason, as_token_ids
from rollout_fleet.core.wire import (
    ROLLOUT_ANNOTATION_PREFIX,
    TURN_TOKENS_ANNOTATION,
    decode_rollout_annotation,
    find_annotation,
)
from rollout_fleet.core.worker_service import serve_rollout_spec
from rollout_fleet.ports.engine import (
    EngineFacts,
    EnginePort,
    KvEventSource,
    offered_keywords,
    streams_without_logprobs,
)

logger = logging.getLogger(__name__)
__all__ = ["CONTROL_SECRET_FIELD", "ControlHandler", "DynamoEngineAdapter"]  # imported from here

PLAIN_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A bad request (4xx, never retried) vs an engine that failed (5xx, retried by the driver).
_REQUEST_FAULTS = (AnnotationError, InvalidValue, EngineRejected)
# How a request kind answers: all its chunks at once, or as they come; and what serves it.
Served = Awaitable[list[GenerateChunk]] | AsyncIterator[GenerateChunk]
RequestKind = Callable[[dict[str, Any], str, str], Served]


class DynamoEngineAdapter(LLMEngine):
    """An ``LLMEngine`` over any ``EnginePort``; the worker owns the engine, not this adapter."""

    def __init__(self, engine: EnginePort, *, model_path: str = "",
                 served_model_name: str | None = None, control_secret: str | None = None,
                 controls: Mapping[str, ControlHandler] | None = None, hold_until_refit: bool = False,
                 worker_name: str | None = None, peers: PeerControls | None = None) -> None:
        self.engine = engine
        self.worker_name = worker_name  # how a refusal names this worker (``worker-0``)
        self.model_path = model_path
        self.served_model_name = served_model_name
        self._facts: EngineFacts | None = None
        self._closed = False
        self.ledger = ServingLedger(held=hold_until_refit)
        self.controls = WorkerControls(engine, self.ledger, control_secret=control_secret,
                                       extra=controls, peers=peers)
        # Dynamo's context id -> the task serving it (cancelled if the engine dies under it).
        self._serving: dict[str, asyncio.Task | None] = {}
        self._offered = offered_keywords(engine)
        self._offered_sampling = engine.sampling_offered()
        self._bare_streams = streams_without_logprobs(engine)
        self._token_texts: TokenTexts | None = None
        self._request_kinds: dict[str, RequestKind] = {
            ROLLOUT_ANNOTATION_PREFIX: self._serve_rollout_request,
            TURN_TOKENS_ANNOTATION: self._plain_request,  # and the turn's tokens at the end
        }

    # -- controls: ``controls.py`` --------------------------------------------------------------
    def supported_controls(self) -> set[str]:
        return self.controls.supported_controls()

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        """Dynamo's entry (its system server answers 200 whatever this says)."""
        return await self.controls.engine_control(control, body)

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        raise NotImplementedError(
            "DynamoEngineAdapter is built by rollout_fleet.wiring.worker (it needs an engine "
            "object), not from command-line arguments")

    def set_model(self, model_path: str, served_model_name: str | None) -> None:
        self.model_path = model_path
        self.served_model_name = served_model_name
        self._token_texts = None

    async def start(self, worker_id: int) -> EngineConfig:
        if not self.model_path:
            raise InvalidValue("model_path", self.model_path, "set it before the worker starts")
        facts = await self.engine.start(worker_id)
        self._facts = facts
        self.ledger.instance_id = worker_id  # Dynamo's id of this worker (nvext.worker_id names it)
        return EngineConfig(
            model=self.model_path,
            served_model_name=self.served_model_name,
            llm=LlmRegistration(
                context_length=facts.context_length,
                kv_cache_block_size=facts.kv_block_size,
                total_kv_blocks=facts.total_kv_blocks,
                max_num_seqs=facts.max_num_seqs,
                max_num_batched_tokens=facts.max_num_batched_tokens,
            ),
        )

    async def kv_event_sources(self) -> list[ZmqSource]:
        return [_zmq_source(source) for source in self.engine.kv_event_sources()]

    @property
    def dead_reason(self) -> str | None:
        """Why this worker's engine died, once it has."""
        return self.ledger.dead_reason

    def engine_died(self, reason: str) -> None:
        """The engine is gone: refuse every request from now on (EngineShutdown, which takes
        this worker out of the frontend's routing), and answer those still waiting on the dead
        engine the same way now, not when the worker's shutdown cancels them (a 499 then);
        the worker then leaves the fleet."""
        if self.ledger.dead_reason is None:
            logger.error("engine died: %s", reason)
        self.ledger.dead_reason = reason
        self._closed = True
        for task in self._serving.values():
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    @property
    def requests_in_flight(self) -> int:
        """Requests this adapter is serving now (rollouts and plain completions)."""
        return len(self._serving)

    @property
    def controls_running(self) -> int:
        """Control calls being handled now (a refit among them pauses the engine)."""
        return self.ledger.controls_running

    async def cleanup(self) -> None:
        # The worker owns the engine and stops it; here only stop taking requests. Idempotent.
        self._closed = True

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[GenerateChunk]:
        if self._closed:
            why = "its engine died" if self.ledger.dead_reason else "it is shutting down"
            raise EngineShutdown(f"this worker is leaving ({why}); retry on another worker")
        if self.ledger.held:
            self.ledger.counts["held_back"] += 1
            # EngineShutdown keeps the frontend off this worker (it retries it every few
            # seconds, answered the same way) and the driver retries the request elsewhere.
            raise EngineShutdown("this worker joined the running fleet and has not received "
                                 "its current weights yet; retry on another worker")
        context_id = context.id()
        annotations = (request.get("annotations")
                       or (request.get("extra_args") or {}).get("nvext", {}).get("annotations"))
        served: Callable[[], Served] = partial(self._plain_request, request, context_id, None)
        for prefix, kind in self._request_kinds.items():
            found = find_annotation(annotations, prefix)
            if found is not None:
                served = partial(kind, request, context_id, found)
                break
        self._serving[context_id] = asyncio.current_task()
        last: GenerateChunk | None = None
        try:
            # A plain request's chunks go out as the engine makes them; a rollout's one chunk
            # when it is done.
            # Closed at once if the client leaves mid-stream: the engine's generation ends too.
            async with contextlib.aclosing(chunks_of(served())) as chunks:
                async for chunk in chunks:
                    last = chunk
                    yield chunk
        except asyncio.CancelledError:
            if self.ledger.dead_reason is None:
                raise  # the client went away, or the worker is stopping
            # Cut off by engine_died: answer it as retryable before the worker goes.
            raise EngineShutdown(f"this worker's engine died ({self.ledger.dead_reason}); retry on "
                                 "another worker") from None
        except EngineAsleep as exc:
            self.ledger.counts["asleep"] += 1
            raise _asleep_answer(str(exc.named(self.worker_name))) from None
        except EngineDead as exc:
            self.engine_died(str(exc))
            # EngineShutdown: the frontend answers 503 (retried by the driver) and takes this
            # worker out of its routing at once (checked with Dynamo 1.6.1).
            raise EngineShutdown(f"this worker's engine died ({exc}); retry on another worker") from None
        except _REQUEST_FAULTS as exc:
            self.ledger.counts["rejected"] += 1
            # InvalidArgument is the one Dynamo error whose message reaches the client (a 400).
            raise InvalidArgument(f"request rejected: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # an engine failure must reach the client, never hang it
            self.ledger.counts["failed"] += 1
            logger.warning("engine failed on context %s: %s: %s", context_id, type(exc).__name__, exc)
            # Unknown answers HTTP 500 (the message stays in this log): a 5xx, which the driver
            # retries; the worker stays in rotation.
            raise Unknown(f"engine failed: {type(exc).__name__}: {exc}") from None
        finally:
            self.ledger.in_flight.pop(context_id, None)
            self._serving.pop(context_id, None)
        self.ledger.counts["served"] += 1
        if last is not None:
            self.ledger.counts["generated_tokens"] += last.get("completion_usage", {}).get(
                "completion_tokens", 0)

    # -- metrics ------------------------------------------------------------------------------
    async def register_prometheus(self, metrics: Any) -> None:
        """Publish generated tokens, prefix-cache hits and KV usage on the worker's /metrics
        (the driver's ``get_logger_metrics`` samples them)."""
        register_worker_metrics(metrics, self.ledger.counts, self.kv_cache_usage)

    def kv_cache_usage(self) -> float | None:
        """The engine's KV usage (0..1), when it reports one."""
        usage = self.engine.kv_cache_usage()
        return None if usage is None else float(usage)

    async def abort(self, context: Any) -> None:
        """Dynamo calls this when the client goes away: abort the engine's request."""
        request_id = self.ledger.in_flight.get(context.id())
        if request_id is None:
            return  # already answered, or never started
        self.ledger.recent_aborts.append(request_id)
        try:
            await self.engine.abort(request_id)
        except Exception:  # an abort that fails must not take the worker down
            logger.exception("engine.abort(%r) failed", request_id)

    async def _serve_rollout_request(self, request: dict[str, Any], context_id: str,
                                     annotation: str) -> list[GenerateChunk]:
        spec = decode_rollout_annotation(annotation)  # once: its request id, then served
        if spec.ignore_eos and "ignore_eos" not in self._offered_sampling:
            raise InvalidValue("ignore_eos", True, "this worker's engine does not offer it")
        if spec.stop_token_ids and "stop_token_ids" not in self._offered:
            raise InvalidValue("stop_token_ids", list(spec.stop_token_ids),
                               "this worker's engine does not offer it")
        prompt = prompt_of(request)
        self.ledger.in_flight[context_id] = spec.request_id
        engine_data = await serve_rollout_spec(self.engine, prompt, spec, worker=self.worker_name,
                                               offered=self._offered)
        if "refused" in engine_data:  # asleep: the refusal rides where the result would
            self.ledger.counts["asleep"] += 1
            return [{"token_ids": [], "index": 0, "finish_reason": "stop",
                     "completion_usage": usage_of(len(prompt), 0),
                     "engine_data": engine_data}]
        # A group's samples all ride in its engine_data; the chunk itself speaks for the first
        # (the driver reads engine_data only), its usage for them all.
        samples = engine_data.get("samples") or [engine_data]
        tokens = samples[0]["token_ids"]
        # Whole result in the final chunk. Its token_ids leave out the hidden stop tokens (EOS):
        # the frontend ends a stream at one, and must not cut this chunk short.
        hidden = hidden_stop_ids(request)
        return [{
            "token_ids": [t for t in tokens if t not in hidden],
            "index": 0,
            "finish_reason": openai_finish(FinishReason(samples[0]["finish_reason"])),
            "completion_usage": usage_of(samples[0]["prompt_tokens"],
                                         sum(len(sample["token_ids"]) for sample in samples)),
            "engine_data": engine_data,
        }]

    async def _plain_request(self, request: dict[str, Any], context_id: str,
                             turn_tokens: str | None) -> AsyncIterator[GenerateChunk]:
        """Token chunks as the engine streams them (the worker cannot tell whether the client
        asked ``stream``: the frontend gathers the chunks for one that did not); with the
        turn-tokens annotation, the last one carries every generated ID and logprob."""
        prompt = prompt_of(request)
        plain = PlainOptions.of(request, self._offered, self._offered_sampling)
        self.ledger.in_flight[context_id] = context_id
        hidden = hidden_stop_ids(request)
        texts = self._texts() if plain.logprobs is not None else None
        keywords = dict(plain.engine_keywords)
        if plain.logprobs is None and self._bare_streams:
            keywords["with_logprobs"] = False  # not asked: the engine need not compute them
        generated = 0
        turn = GeneratedTurn(self.engine) if turn_tokens is not None else None
        pieces = self.engine.stream_rollout(
            prompt, request_id=context_id,
            max_new_tokens=self._plain_budget(len(prompt), plain.max_tokens),
            sampling=plain.sampling, stop_strings=plain.stop_strings, **keywords)
        async with closed_on_exit(pieces):
            async for piece in pieces:
                generated += len(piece.token_ids)
                if turn is not None:
                    turn.add(piece)
                chunks = piece_chunks(piece, hidden, logprobs=plain.logprobs is not None,
                                       texts=texts)
                if piece.finish_reason is not None:
                    self._count_prefix_cache(len(prompt), piece.cached_prompt_tokens)
                    if not chunks:
                        chunks = [{"token_ids": [], "index": 0}]
                    chunks[-1]["finish_reason"] = openai_finish(piece.finish_reason)
                    chunks[-1]["completion_usage"] = usage_of(len(prompt), generated)
                    if turn is not None:
                        chunks[-1]["engine_data"] = turn.engine_data()
                for chunk in chunks:
                    yield chunk

    def _count_prefix_cache(self, prompt_tokens: int, cached: int | None) -> None:
        """A plain request's prefix-cache hit, where the engine told it (agent turns: the hit
        of each turn on the earlier ones), into the worker's running counts."""
        if cached is not None:
            self.ledger.counts["prefix_cache_queried_tokens"] += prompt_tokens
            self.ledger.counts["prefix_cache_hit_tokens"] += cached

    def _texts(self) -> "TokenTexts":
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.model_path)
        return self._token_texts

    def _plain_budget(self, prompt_len: int, max_tokens: Any) -> int:
        wanted = PLAIN_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        check_int_at_least("max_tokens", wanted, 1)
        if self._facts is not None:
            room = self._facts.context_length - prompt_len
            if room < 1:
                raise InvalidValue("prompt", f"{prompt_len} tokens",
                                   f"leaves no room within context_length={self._facts.context_length}")
            wanted = min(wanted, room)
        return wanted


def _zmq_source(source: KvEventSource) -> ZmqSource:
    if source.kind != "zmq":
        raise InvalidValue("kv_event_sources[].kind", source.kind, "Dynamo takes only 'zmq' sources")
    return ZmqSource(endpoint=source.endpoint, topic=source.topic)




def _asleep_answer(message: str) -> Exception:
    """A plain request refused by a sleeping engine: a 503 (Dynamo's frontend hides a 5xx's
    message; a rollout carries it in its engine_data instead), and the worker stays in the
    frontend's routing, so it serves at once when woken."""
    from dynamo.llm.exceptions import HttpError

    return HttpError(503, message)


def prompt_of(request: Mapping[str, Any]) -> tuple[int, ...]:
    """The request's token-ID prompt, checked once, here, where it arrives: the engine takes
    it as it is (and checks only its own vocabulary)."""
    prompt = request.get("token_ids")
    if not isinstance(prompt, list) or not prompt:
        raise InvalidValue("token_ids", prompt, "a prompt needs at least one token ID")
    return as_token_ids(prompt, "token_ids")


def hidden_stop_ids(request: Mapping[str, Any]) -> set[int]:
    stop = request.get("stop_conditions") or {}
    return set(stop.get("stop_token_ids_hidden") or ()) | set(request.get("eos_token_ids") or ())


async def chunks_of(served: Served) -> AsyncGenerator[GenerateChunk, None]:
    """The chunks of a request kind's answer: an async iterator of chunks, or a coroutine
    that returns them all."""
    if isinstance(served, AsyncIterator):
        async with closed_on_exit(served):
            async for chunk in served:
                yield chunk
        return
    for chunk in await served:
        yield chunk


def openai_finish(reason: FinishReason) -> str:
    return "cancelled" if reason is FinishReason.ABORT else reason.value


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
