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
import collections
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from dynamo.common.backend import (
    EngineConfig,
    GenerateChunk,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.publisher import ZmqSource
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown
from rollout_fleet.core.errors import AnnotationError, EngineDead, EngineRejected, InvalidValue
from rollout_fleet.core.validate import check_int_at_least
from rollout_fleet.core.rollout import FinishReason, SamplingSpec
from rollout_fleet.core.sampling import NEUTRAL_SAMPLING, extra_sampling
from rollout_fleet.core.wire import (
    ROLLOUT_ANNOTATION_PREFIX,
    decode_rollout_annotation,
    find_annotation,
)
from rollout_fleet.core.worker_service import serve_annotated_rollout
from rollout_fleet.ports.engine import (
    EngineFacts,
    EnginePort,
    KvEventSource,
    RefitTarget,
    RolloutPiece,
    offered_keywords,
)

logger = logging.getLogger(__name__)

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
CONTROL_SECRET_FIELD = "control_secret"
PLAIN_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_RECENT_ABORTS_KEPT = 256
# Options of a plain request that the engine port has no way to honour: a non-null value is
# refused by name (a 400), so a client never gets an answer computed without them.
_UNOFFERED_SAMPLING = ("length_penalty", "guided_decoding")
# The control whose first success lets a worker that joined late serve.
_FIRST_REFIT_CONTROL = "update_weights"
# A bad request (4xx, never retried) vs an engine that failed (5xx, retried by the driver).
_REQUEST_FAULTS = (AnnotationError, InvalidValue, EngineRejected)


class DynamoEngineAdapter(LLMEngine):
    """An ``LLMEngine`` over any ``EnginePort``; the worker owns the engine, not this adapter."""

    def __init__(self, engine: EnginePort, *, model_path: str = "",
                 served_model_name: str | None = None, control_secret: str | None = None,
                 controls: Mapping[str, ControlHandler] | None = None,
                 hold_until_refit: bool = False) -> None:
        self.engine = engine
        self.model_path = model_path
        self.served_model_name = served_model_name
        self._control_secret = control_secret
        self._facts: EngineFacts | None = None
        self._instance_id: int | None = None
        self._closed = False
        # A worker that joined a running fleet serves nothing until its first refit has loaded
        # the fleet's current weights (the ``update_weights`` control succeeded).
        self._held = hold_until_refit
        self._dead_reason: str | None = None  # set once the engine died
        # Dynamo's context id -> the task serving it (cancelled if the engine dies under it).
        self._serving: dict[str, asyncio.Task | None] = {}
        # Dynamo's context id -> the request id the engine knows (a rollout's own id).
        self._in_flight: dict[str, str] = {}
        self._offered = offered_keywords(engine)
        self._offered_sampling = engine.sampling_offered()
        self._token_texts: _TokenTexts | None = None
        self._recent_aborts: collections.deque[str] = collections.deque(maxlen=_RECENT_ABORTS_KEPT)
        self._counts = collections.Counter()
        self._controls_running = 0  # a refit may pause the engine: no progress is no hang then
        self._request_kinds: dict[str, Callable[..., Awaitable[list[GenerateChunk]]]] = {
            ROLLOUT_ANNOTATION_PREFIX: self._serve_rollout_request,
        }
        self._controls: dict[str, ControlHandler] = self._builtin_controls()
        for name, handler in (controls or {}).items():
            if name in self._controls:
                raise InvalidValue("controls", name, "collides with a built-in control")
            self._controls[name] = handler

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
        self._instance_id = worker_id  # Dynamo's id of this worker (nvext.worker_id names it)
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
        return self._dead_reason

    def engine_died(self, reason: str) -> None:
        """The engine is gone: refuse every request from now on (EngineShutdown, which takes
        this worker out of the frontend's routing), and answer those still waiting on the dead
        engine the same way now, not when the worker's shutdown cancels them (a 499 then);
        the worker then leaves the fleet."""
        if self._dead_reason is None:
            logger.error("engine died: %s", reason)
        self._dead_reason = reason
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
        return self._controls_running

    async def cleanup(self) -> None:
        # The worker owns the engine and stops it; here only stop taking requests. Idempotent.
        self._closed = True

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[GenerateChunk]:
        if self._closed:
            why = "its engine died" if self._dead_reason else "it is shutting down"
            raise EngineShutdown(f"this worker is leaving ({why}); retry on another worker")
        if self._held:
            self._counts["held_back"] += 1
            # EngineShutdown keeps the frontend off this worker (it retries it every few
            # seconds, answered the same way) and the driver retries the request elsewhere.
            raise EngineShutdown("this worker joined the running fleet and has not received "
                                 "its current weights yet; retry on another worker")
        context_id = context.id()
        annotations = (request.get("annotations")
                       or (request.get("extra_args") or {}).get("nvext", {}).get("annotations"))
        serve, annotation = self._plain_request, None
        for prefix, kind in self._request_kinds.items():
            found = find_annotation(annotations, prefix)
            if found is not None:
                serve, annotation = kind, found
                break
        self._serving[context_id] = asyncio.current_task()
        last: GenerateChunk | None = None
        try:
            # A plain request's chunks go out as the engine makes them; a rollout's one chunk
            # when it is done.
            # Closed at once if the client leaves mid-stream: the engine's generation ends too.
            async with contextlib.aclosing(_chunks_of(serve(request, context_id, annotation))) as chunks:
                async for chunk in chunks:
                    last = chunk
                    yield chunk
        except asyncio.CancelledError:
            if self._dead_reason is None:
                raise  # the client went away, or the worker is stopping
            # Cut off by engine_died: answer it as retryable before the worker goes.
            raise EngineShutdown(f"this worker's engine died ({self._dead_reason}); retry on "
                                 "another worker") from None
        except EngineDead as exc:
            self.engine_died(str(exc))
            # EngineShutdown: the frontend answers 503 (retried by the driver) and takes this
            # worker out of its routing at once (checked with Dynamo 1.6.1).
            raise EngineShutdown(f"this worker's engine died ({exc}); retry on another worker") from None
        except _REQUEST_FAULTS as exc:
            self._counts["rejected"] += 1
            # InvalidArgument is the one Dynamo error whose message reaches the client (a 400).
            raise InvalidArgument(f"request rejected: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # an engine failure must reach the client, never hang it
            self._counts["failed"] += 1
            logger.warning("engine failed on context %s: %s: %s", context_id, type(exc).__name__, exc)
            # Unknown answers HTTP 500 (the message stays in this log): a 5xx, which the driver
            # retries; the worker stays in rotation.
            raise Unknown(f"engine failed: {type(exc).__name__}: {exc}") from None
        finally:
            self._in_flight.pop(context_id, None)
            self._serving.pop(context_id, None)
        self._counts["served"] += 1
        if last is not None:
            self._counts["generated_tokens"] += last.get("completion_usage", {}).get(
                "completion_tokens", 0)

    # -- metrics ------------------------------------------------------------------------------
    async def register_prometheus(self, metrics: Any) -> None:
        """Publish generated tokens and KV usage on the worker's /metrics (the driver's
        ``get_logger_metrics`` samples them)."""
        from dynamo.common.backend.metrics import register_engine_registry
        from prometheus_client import CollectorRegistry
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        adapter = self

        class _Collector:
            def collect(self):
                yield CounterMetricFamily("rollout_fleet_generated_tokens",
                                          "tokens generated by this worker's engine",
                                          value=adapter._counts["generated_tokens"])
                usage = adapter.kv_cache_usage()
                if usage is not None:
                    yield GaugeMetricFamily("rollout_fleet_kv_cache_usage_perc",
                                            "fraction of the engine's KV cache in use", value=usage)

        registry = CollectorRegistry()
        registry.register(_Collector())
        register_engine_registry(metrics, registry, prefix_filters=["rollout_fleet_"])

    def kv_cache_usage(self) -> float | None:
        """The engine's KV usage (0..1), when it reports one."""
        usage = self.engine.kv_cache_usage()
        return None if usage is None else float(usage)

    async def abort(self, context: Any) -> None:
        """Dynamo calls this when the client goes away: abort the engine's request."""
        request_id = self._in_flight.get(context.id())
        if request_id is None:
            return  # already answered, or never started
        self._recent_aborts.append(request_id)
        try:
            await self.engine.abort(request_id)
        except Exception:  # an abort that fails must not take the worker down
            logger.exception("engine.abort(%r) failed", request_id)

    async def _serve_rollout_request(self, request: dict[str, Any], context_id: str,
                                     annotation: str) -> list[GenerateChunk]:
        spec = decode_rollout_annotation(annotation)  # for its request id, before serving
        if spec.stop_token_ids and "stop_token_ids" not in self._offered:
            raise InvalidValue("stop_token_ids", list(spec.stop_token_ids),
                               "this worker's engine does not offer it")
        self._in_flight[context_id] = spec.request_id
        engine_data = await serve_annotated_rollout(self.engine, _prompt_of(request), annotation)
        tokens = engine_data["token_ids"]
        # Whole result in the final chunk. Its token_ids leave out the hidden stop tokens (EOS):
        # the frontend ends a stream at one, and must not cut this chunk short.
        hidden = _hidden_stop_ids(request)
        return [{
            "token_ids": [t for t in tokens if t not in hidden],
            "index": 0,
            "finish_reason": _openai_finish(FinishReason(engine_data["finish_reason"])),
            "completion_usage": _usage(engine_data["prompt_tokens"], len(tokens)),
            "engine_data": engine_data,
        }]

    async def _plain_request(self, request: dict[str, Any], context_id: str,
                             _annotation: None) -> AsyncIterator[GenerateChunk]:
        """Token chunks as the engine streams them (the worker cannot tell whether the client
        asked ``stream``: the frontend gathers the chunks for one that did not)."""
        prompt = _prompt_of(request)
        plain = _PlainOptions.of(request, self._offered, self._offered_sampling)
        self._in_flight[context_id] = context_id
        hidden = _hidden_stop_ids(request)
        texts = self._texts() if plain.logprobs is not None else None
        generated = 0
        pieces = self.engine.stream_rollout(
            prompt, request_id=context_id,
            max_new_tokens=self._plain_budget(len(prompt), plain.max_tokens),
            sampling=plain.sampling, stop_strings=plain.stop_strings, **plain.engine_keywords)
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                generated += len(piece.token_ids)
                chunks = _piece_chunks(piece, hidden, logprobs=plain.logprobs is not None,
                                       texts=texts)
                if piece.finish_reason is not None:
                    if not chunks:
                        chunks = [{"token_ids": [], "index": 0}]
                    chunks[-1]["finish_reason"] = _openai_finish(piece.finish_reason)
                    chunks[-1]["completion_usage"] = _usage(len(prompt), generated)
                for chunk in chunks:
                    yield chunk

    def _texts(self) -> "_TokenTexts":
        if self._token_texts is None:
            self._token_texts = _TokenTexts(self.model_path)
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

    # -- control surface ----------------------------------------------------------------------
    def supported_controls(self) -> set[str]:
        return set(self._controls)

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        """Dynamo's entry (its system server answers 200 whatever this says)."""
        return (await self.answer_control(control, body))[1]

    async def answer_control(self, control: str, body: Any) -> tuple[int, dict[str, Any]]:
        """(HTTP status, answer) of one control call: 401 for a missing or wrong secret, 404
        for an unknown control, else 200 (a failed handler answers ``status: error``)."""
        handler = self._controls.get(control)
        if handler is None:
            return 404, _error(f"unknown control {control!r}; this worker has {sorted(self._controls)}")
        if not isinstance(body, dict):
            return 200, _error(f"control {control!r}: the body must be a JSON object")
        refusal = self._secret_refusal(body)
        if refusal:
            return 401, _error(f"control {control!r} refused: {refusal}")
        return 200, await self._run_control(control, handler, body)

    async def _run_control(self, control: str, handler: ControlHandler,
                           body: dict[str, Any]) -> dict[str, Any]:
        args = {k: v for k, v in body.items() if k != CONTROL_SECRET_FIELD}
        self._controls_running += 1
        try:
            answer = await handler(args)
        except Exception as exc:
            logger.warning("control %r failed: %s: %s", control, type(exc).__name__, exc)
            return _error(f"control {control!r} failed: {type(exc).__name__}: {exc}")
        finally:
            self._controls_running -= 1
        if control == _FIRST_REFIT_CONTROL and self._held:
            self._held = False
            logger.info("serving from now on: the fleet's weights are loaded (version %s)",
                        (answer or {}).get("weight_version"))
        return {"status": "ok", **(answer or {})}

    def _secret_refusal(self, body: Mapping[str, Any]) -> str | None:
        if self._control_secret is None:
            return None
        given = body.get(CONTROL_SECRET_FIELD)
        if not isinstance(given, str):
            return f"the body has no {CONTROL_SECRET_FIELD!r} string"
        if not hmac.compare_digest(given.encode(), self._control_secret.encode()):
            return f"{CONTROL_SECRET_FIELD!r} does not match this worker's"
        return None

    def _builtin_controls(self) -> dict[str, ControlHandler]:
        controls: dict[str, ControlHandler] = {"stats": self._stats,
                                               "abort_rollout": self._abort_rollout}
        if isinstance(self.engine, RefitTarget):
            controls["flush_cache"] = self._flush_cache
            controls["weight_version"] = self._weight_version
        return controls

    async def _abort_rollout(self, body: dict[str, Any]) -> dict[str, Any]:
        """Cut a rollout short: its own request answers with what it generated so far
        (finish reason ``abort``). An id not here yet is remembered by the engine."""
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidValue("request_id", request_id, "must be a non-empty string")
        was_in_flight = request_id in self._in_flight.values()
        await self.engine.abort(request_id)
        return {"was_in_flight": was_in_flight}

    async def _flush_cache(self, _body: dict[str, Any]) -> dict[str, Any]:
        await self.engine.reset_cache()  # type: ignore[attr-defined]
        return {}

    async def _weight_version(self, _body: dict[str, Any]) -> dict[str, Any]:
        return {"weight_version": self.engine.weight_version()}  # type: ignore[attr-defined]

    async def _stats(self, _body: dict[str, Any]) -> dict[str, Any]:
        return {
            "in_flight": len(self._in_flight),
            "served": self._counts["served"],
            "rejected": self._counts["rejected"],
            "failed": self._counts["failed"],
            "aborted_request_ids": list(self._recent_aborts),
            "instance_id": self._instance_id,
            "engine_dead": self._dead_reason,
            "held": self._held,
            "held_back": self._counts["held_back"],
        }


def _prompt_of(request: Mapping[str, Any]) -> Sequence[int]:
    prompt = request.get("token_ids")
    if not isinstance(prompt, list) or not prompt:
        raise InvalidValue("token_ids", prompt, "a prompt needs at least one token ID")
    return prompt


def _hidden_stop_ids(request: Mapping[str, Any]) -> set[int]:
    stop = request.get("stop_conditions") or {}
    return set(stop.get("stop_token_ids_hidden") or ()) | set(request.get("eos_token_ids") or ())


@attrs.frozen
class _PlainOptions:
    """What an ordinary OpenAI request asks of the engine, checked against what it offers."""

    max_tokens: Any
    sampling: SamplingSpec
    stop_strings: tuple[str, ...]
    logprobs: int | None  # None: not asked; 0: the chosen token's; N: and the N most likely
    engine_keywords: dict[str, Any]

    @classmethod
    def of(cls, request: Mapping[str, Any], offered: frozenset[str],
           offered_sampling: frozenset[str] = frozenset()) -> "_PlainOptions":
        options = request.get("sampling_options") or {}
        stop = request.get("stop_conditions") or {}
        output = request.get("output_options") or {}
        _refuse_unoffered(options, output)
        _refuse_choices(options)
        logprobs = output.get("logprobs")
        if logprobs is not None:
            check_int_at_least("logprobs", logprobs, 0)
        keywords: dict[str, Any] = {}
        if logprobs:
            keywords["top_logprobs"] = logprobs
        stop_ids = stop.get("stop_token_ids") or []
        if stop_ids:
            keywords["stop_token_ids"] = tuple(stop_ids)
        missing = sorted(set(keywords) - offered)
        if missing:
            asked = {"top_logprobs": "logprobs > 0 (top alternatives)",
                     "stop_token_ids": "stop_token_ids"}
            raise InvalidValue(asked[missing[0]], keywords[missing[0]],
                               "this worker's engine does not offer it")
        extra = _extra_sampling(request, options, stop)
        for name in sorted(set(extra) - offered_sampling):
            raise InvalidValue(name, extra[name], "not offered by this fleet's engine port")
        if extra:
            keywords["extra_sampling"] = extra
        return cls(stop.get("max_tokens"), _plain_sampling(options),
                   tuple(stop.get("stop") or ()), logprobs, keywords)


def _extra_sampling(request: Mapping[str, Any], options: Mapping[str, Any],
                    stop: Mapping[str, Any]) -> dict[str, Any]:
    """The non-neutral sampling options a request asks for, wherever the frontend put them
    (penalties and min_p in sampling_options, min_tokens and ignore_eos in stop_conditions,
    allowed_token_ids passed through in extra_args.sampling_options)."""
    passed = (request.get("extra_args") or {}).get("sampling_options") or {}
    for name, value in passed.items():
        if name not in NEUTRAL_SAMPLING and value is not None:
            raise InvalidValue(name, value, "not offered by this fleet's engine port")
    values = {name: options.get(name) for name in NEUTRAL_SAMPLING}
    values.update({name: stop.get(name) for name in ("min_tokens", "ignore_eos")})
    values.update({name: value for name, value in passed.items() if value is not None})
    return extra_sampling(values)


def _refuse_choices(options: Mapping[str, Any]) -> None:
    """n > 1 is refused: Dynamo 1.6.1's frontend ends an answer at the first choice that
    finishes, so the other choices would come back cut short (checked with 1.6.1)."""
    for name in ("n", "best_of"):
        value = options.get(name)
        if value is not None and value != 1:
            raise InvalidValue(name, value, "this fleet answers one choice per request "
                               "(the frontend cuts the others short); send n requests instead")


def _refuse_unoffered(options: Mapping[str, Any], output: Mapping[str, Any]) -> None:
    for name in _UNOFFERED_SAMPLING:
        if options.get(name) is not None:
            raise InvalidValue(name, options[name], "not offered by this fleet's engine port")
    if options.get("use_beam_search"):
        raise InvalidValue("use_beam_search", True, "beam search is not offered")
    if output.get("prompt_logprobs") is not None:  # also how the frontend passes echo
        raise InvalidValue("echo / prompt_logprobs", output["prompt_logprobs"],
                           "the engine does not compute prompt logprobs")


def _plain_sampling(options: Mapping[str, Any]) -> SamplingSpec:
    temperature = options.get("temperature")
    if temperature is not None and temperature == 0:
        return SamplingSpec(greedy=True)
    top_k = options.get("top_k")
    return SamplingSpec(
        greedy=False,
        temperature=1.0 if temperature is None else temperature,  # OpenAI's default
        top_p=options.get("top_p") if options.get("top_p") is not None else 1.0,
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=options.get("seed"),
    )


class _TokenTexts:
    """Token ID -> its text, for the alternatives in ``top_logprobs`` (the model folder's
    ``tokenizer.json``; None where there is none to read)."""

    def __init__(self, model_path: str) -> None:
        self._tokenizer = None
        try:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        except Exception as exc:  # no folder, no file, or no tokenizers library: no texts
            logger.info("no token texts for logprobs (%s: %s)", type(exc).__name__, exc)

    def __call__(self, token_id: int) -> str | None:
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _piece_chunks(piece: RolloutPiece, hidden: set[int], *, logprobs: bool = False,
                  texts: Callable[[int], str | None] | None = None) -> list[GenerateChunk]:
    """The chunk of a piece: its visible tokens (one engine step's, or several when the engine
    ran ahead of this loop), with their logprobs (and the top alternatives) when asked. Hidden
    stop tokens (EOS) are left out: the frontend ends a stream at one."""
    steps = zip(piece.token_ids, piece.logprobs, piece.top_logprobs or ((),) * len(piece.token_ids))
    shown = [(t, lp, top) for t, lp, top in steps if t not in hidden]
    if not shown:
        return []
    chunk: GenerateChunk = {"token_ids": [t for t, _, _ in shown], "index": 0}
    if logprobs:
        chunk["log_probs"] = [lp for _, lp, _ in shown]
        chunk["top_logprobs"] = [[
            {"rank": rank, "token_id": alt, "token": texts(alt) if texts else None,
             "logprob": alt_logprob}
            for rank, (alt, alt_logprob) in enumerate(top, start=1)] for _, _, top in shown]
    return [chunk]


async def _chunks_of(served: Any) -> AsyncIterator[GenerateChunk]:
    """The chunks of a request kind's answer: an async iterator of chunks, or a coroutine
    that returns them all."""
    if hasattr(served, "__aiter__"):
        async with contextlib.aclosing(served):
            async for chunk in served:
                yield chunk
        return
    for chunk in await served:
        yield chunk


def _openai_finish(reason: FinishReason) -> str:
    return "cancelled" if reason is FinishReason.ABORT else reason.value


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _zmq_source(source: KvEventSource) -> ZmqSource:
    if source.kind != "zmq":
        raise InvalidValue("kv_event_sources[].kind", source.kind, "Dynamo takes only 'zmq' sources")
    return ZmqSource(endpoint=source.endpoint, topic=source.topic)


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}
