"""VllmEngine: the engine port and the refit port over vLLM's AsyncLLM.

One engine owns one vLLM engine in this process's event loop; vLLM runs the model in its own
engine-core and worker processes. Rollouts are token-ID prompts in, every generated token with
its logprob out, exactly as a native ``generate`` would answer them.

Refits are received inside vLLM's worker processes, where the weights live: each engine rank's
weight-transfer engine (the project's packed protocol, ``transfer_engine.py``, registered with
vLLM by the composition root; or vLLM's own ``nccl`` engine for trainers that speak vLLM's
protocol) joins the trainer's group and loads every bucket as it arrives. This process only
sends the requests (join, refit info) and never holds a weight.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.adapters.shared.shm import SharedMemoryTracker
from rollout_fleet.adapters.vllm.config import KV_EVENTS_TOPIC, VllmEngineConfig, precision_env
from rollout_fleet.adapters.vllm.convert import (
    _check_vocabulary, _engine_dtype, _piece_of, _read_facts, _sampling_params, _served, _to_served,
)
from rollout_fleet.adapters.vllm.features import VllmFeatures, detect_features
from rollout_fleet.adapters.vllm.process import (
    _child_pids, _cpu_binding, _environment, _freeze_startup_objects, _in_thread,
    _set_worker_priority, _track_segments, _unfreeze_and_collect,
)
from rollout_fleet.adapters.vllm.colocated import VllmColocated
from rollout_fleet.adapters.vllm.refit import VllmRefit
from rollout_fleet.adapters.vllm.sleep import VllmSleep
from rollout_fleet.adapters.vllm.weights import checkpoint_metas, tied_metas
from rollout_fleet.core.errors import EngineDead, EngineError, EngineRejected
from rollout_fleet.core.refit import TensorMeta
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout
from rollout_fleet.ports.engine import (
    SAMPLING_OPTIONS,
    EngineFacts,
    EnginePort,
    KvEventSource,
    RolloutPiece,
)

log = logging.getLogger(__name__)

_EARLY_ABORTS_KEPT = 4096
_SHUTDOWN_TIMEOUT_S = 30.0


@attrs.define
class _Live:
    """One rollout this adapter is serving."""

    admitted: bool = False  # vLLM knows the request id: an abort can go straight to it
    aborted: bool = False


class VllmEngine(EnginePort, VllmRefit, VllmSleep, VllmColocated):
    """The vLLM backend of a rollout-fleet worker (refit: ``refit.py``; sleep and wake:
    ``sleep.py``; colocated refit: ``colocated.py``)."""

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self._engine: Any = None  # vllm.v1.engine.async_llm.AsyncLLM, once started
        self._facts: EngineFacts | None = None
        self._metas: dict[str, TensorMeta] = {}
        self._ignored: dict[str, TensorMeta] = {}  # accepted in a refit; vLLM's loader skips them
        self._start_lock = asyncio.Lock()
        self._weight_lock = asyncio.Lock()
        self._live: dict[str, _Live] = {}
        self._early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._version = 0
        self._kv_salt: str | None = None  # set after a keep-mode refit left old KV in use
        self._joined = False
        self._torn: str | None = None  # why rollouts are refused: a refit died half way
        self._segments: list[SharedMemoryTracker] = []  # vLLM's /dev/shm queues, per engine core
        self._engine_processes: set[int] = set()  # what vLLM started under this process
        self._features: VllmFeatures | None = None  # what this vLLM offers (features.py)
        self._steps = 0  # engine-core outputs received: grows with every step (``progress``)
        self._init_sleep()

    # -- engine port --------------------------------------------------------------------------
    async def start(self, worker_id: int | str) -> EngineFacts:
        async with self._start_lock:
            if self._engine is None:
                # Building the engine blocks for ~20 s on a CPU (it spawns and waits for the
                # engine core); a thread keeps this loop answering meanwhile.
                children_before = _child_pids()
                with _cpu_binding(self.config), _environment(precision_env(self.config)):
                    self._engine = await _in_thread(_build_engine, self.config)
                self._features = detect_features(self._engine)
                self._engine_processes = _child_pids() - children_before
                self._count_steps(self._engine)
                self._segments = _track_segments(self._engine_processes)
                if self.config.device == "cpu" and self.config.cpu_worker_nice is not None:
                    _set_worker_priority(self.config.cpu_worker_nice, self._engine_processes)
                await self._label_weight_version()
                self._facts = _read_facts(self._engine)
                folder = self._engine.model_config.model
                self._metas = checkpoint_metas(folder, _engine_dtype(self._engine))
                self._ignored = tied_metas(folder, self._metas)
                _freeze_startup_objects()
                log.info("vLLM engine up for worker %s: %s; %s", worker_id, self._facts, self._features)
                await self._report_precision(worker_id)
        return self._facts

    def sampling_offered(self) -> frozenset[str]:
        return frozenset(SAMPLING_OPTIONS)  # each is a SamplingParams field of the same name

    async def serve_rollout(self, prompt_token_ids: Sequence[int], *, request_id: str,
                            max_new_tokens: int, sampling: SamplingSpec,
                            stop_strings: Sequence[str] = (), top_logprobs: int = 0,
                            stop_token_ids: Sequence[int] = (),
                            extra_sampling: Mapping[str, Any] | None = None) -> ServedRollout:
        engine = self._require_engine()
        prompt = self._admissible(prompt_token_ids, max_new_tokens, stop_token_ids, extra_sampling)
        if self._early_aborts.pop(request_id, "absent") is None:
            return _served([], [], FinishReason.ABORT, len(prompt), self._version)
        params = _sampling_params(sampling, max_new_tokens, stop_strings, top_logprobs,
                                  stop_token_ids, extra_sampling)
        live = self._live[request_id] = _Live()
        try:
            output = await self._generate(engine, prompt, params, request_id, live)
        except Exception as error:
            reason = self.dead_reason()
            if reason is not None:  # not this request's fault: another worker can serve it
                raise EngineDead(reason) from error
            raise
        finally:
            self._live.pop(request_id, None)
        # vLLM labels each step's tokens with the weight version set while it was paused for
        # the swap (``_commit_new_weights``): per-token versions, exact whatever the pause mode.
        return _to_served(output, len(prompt), self._version, top_logprobs)

    async def stream_rollout(self, prompt_token_ids: Sequence[int], *, request_id: str,
                             max_new_tokens: int, sampling: SamplingSpec,
                             stop_strings: Sequence[str] = (), with_logprobs: bool = True,
                             top_logprobs: int = 0, stop_token_ids: Sequence[int] = (),
                             extra_sampling: Mapping[str, Any] | None = None
                             ) -> AsyncIterator[RolloutPiece]:
        """A piece per engine step, as vLLM hands out each step's new tokens (its DELTA
        outputs). Without logprobs, vLLM's sampler computes none and its front builds none per
        token, as for a request to vLLM's own server that asks for none."""
        engine = self._require_engine()
        prompt = self._admissible(prompt_token_ids, max_new_tokens, stop_token_ids, extra_sampling)
        if self._early_aborts.pop(request_id, "absent") is None:
            yield RolloutPiece((), (), FinishReason.ABORT)
            return
        with_logprobs = with_logprobs or top_logprobs > 0
        params = _sampling_params(sampling, max_new_tokens, stop_strings, top_logprobs,
                                  stop_token_ids, extra_sampling, stream=True,
                                  logprobs=with_logprobs)
        live = self._live[request_id] = _Live()
        try:
            async with contextlib.aclosing(self._outputs(engine, prompt, params, request_id,
                                                         live)) as outputs:
                async for output in outputs:  # closed at once if our consumer stops early
                    yield _piece_of(output, top_logprobs, with_logprobs)
        except Exception as error:
            reason = self.dead_reason()
            if reason is not None:
                raise EngineDead(reason) from error
            raise
        finally:
            self._live.pop(request_id, None)

    def _admissible(self, prompt_token_ids: Sequence[int], max_new_tokens: int,
                    stop_token_ids: Sequence[int] = (),
                    extra_sampling: Mapping[str, Any] | None = None) -> list[int]:
        self._sleep.check_serving()  # asleep, or woke without weights: EngineAsleep (a 503)
        if self._torn:
            raise EngineError(f"this worker's weights are torn ({self._torn}); it serves again"
                              " after a refit succeeds")
        prompt = list(prompt_token_ids)
        self._check_input(prompt, max_new_tokens)
        if stop_token_ids or extra_sampling:
            vocab = self._engine.model_config.get_vocab_size()
            extra = extra_sampling or {}
            for field, ids in (("stop_token_ids", stop_token_ids),
                               ("allowed_token_ids", extra.get("allowed_token_ids") or ()),
                               ("logit_bias", list(extra.get("logit_bias") or ()))):
                _check_vocabulary(field, ids, vocab)
        return prompt

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:  # not here yet (or long gone): remember, so it ends as soon as it comes
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > _EARLY_ABORTS_KEPT:
                self._early_aborts.popitem(last=False)
            return
        live.aborted = True
        if live.admitted:
            await self._engine.abort(request_id)

    def progress(self) -> int:
        return self._steps

    def _count_steps(self, engine: Any) -> None:
        """Count each batch of outputs vLLM's output loop takes from the engine core (one per
        step with work): a hung engine core sends none, so the count stands still."""
        core = engine.engine_core
        receive = core.get_output_async

        async def counted_receive():
            outputs = await receive()
            self._steps += 1
            return outputs

        core.get_output_async = counted_receive

    def dead_reason(self) -> str | None:
        """vLLM's engine core is gone (killed, crashed): this engine serves nothing more."""
        engine = self._engine
        if engine is None or not engine.errored:
            return None
        return f"vLLM's engine core died ({type(engine.dead_error).__name__})"

    def kv_event_sources(self) -> Sequence[KvEventSource]:
        if self._engine is None or self.config.kv_events_port is None:
            return ()
        if not self._features.kv_event_sources:  # an older vLLM: the sources it was told
            return (KvEventSource(kind="zmq", endpoint=self.config.kv_events_endpoint,
                                  topic=KV_EVENTS_TOPIC),)
        sources = []
        for events in self._engine.get_kv_event_sources().values():
            if events.enable_kv_cache_events and events.publisher == "zmq":
                sources.append(KvEventSource(
                    kind="zmq", endpoint=events.endpoint.replace("*", "127.0.0.1"),
                    topic=events.topic, replay_endpoint=events.replay_endpoint))
        return tuple(sources)

    # -- lifecycle ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop vLLM's engine-core and worker processes; safe to call twice."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for tracker in self._segments:  # what the engine core's processes use at the end
            tracker.scan()
        handler = engine.output_handler
        if handler is not None:  # first, or it reports the engine core's exit as an error
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        # Room for the engine core to finish its teardown: killed at vLLM's default 5 s (on a
        # busy host), it leaves its shared-memory queues behind in /dev/shm.
        await _in_thread(engine.shutdown, _SHUTDOWN_TIMEOUT_S)
        del engine
        _unfreeze_and_collect()
        endpoint = self.config.kv_events_endpoint or ""
        if endpoint.startswith("ipc://"):  # the KV-event socket's file outlives its socket
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoint[len("ipc://"):])
        # An engine core that was killed, or outlived the shutdown timeout, leaves its queues.
        for tracker in self._segments:
            tracker.remove_all()
        self._segments = []

    # -- internals ----------------------------------------------------------------------------
    def _require_engine(self) -> Any:
        if self._engine is None:
            raise EngineError("the vLLM engine is not started: call start() first")
        return self._engine

    def _check_input(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise EngineRejected("prompt_token_ids is empty")
        _check_vocabulary("prompt_token_ids", prompt, self._engine.model_config.get_vocab_size())
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineRejected(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
        context = self._facts.context_length
        if len(prompt) + max_new_tokens > context:
            raise EngineRejected(f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} "
                              f"exceeds context_length={context}")

    async def _report_precision(self, worker_id: int | str) -> None:
        """Log, and print to the worker's output, what the engine serves in: the parameters'
        dtype and the float32 matmul precision of each engine rank."""
        ranks = await self._engine.collective_rpc("rollout_fleet_precision")
        served = _engine_dtype(self._engine)
        line = (f"worker {worker_id} serves dtype={served}"
                f" (checkpoint {self.config.checkpoint_dtype() or 'unknown'}); per rank: "
                + "; ".join(", ".join(f"{k}={v}" for k, v in rank.items()) for rank in ranks))
        log.info("%s", line)
        print(line, flush=True)
        checkpoint = self.config.checkpoint_dtype()
        if checkpoint and checkpoint != served:
            log.warning("the checkpoint is %s but vLLM serves it in %s (engine.dtype=%r)",
                        checkpoint, served, self.config.dtype)

    async def _admit(self, engine: Any, prompt: list[int], params: Any, request_id: str,
                     live: _Live) -> Any:
        from vllm.inputs.engine import tokens_input

        try:
            collector = await engine.add_request(
                request_id, tokens_input(prompt, cache_salt=self._kv_salt), params)
        except Exception as error:  # vLLM's validation: name the cause, keep serving
            if self.dead_reason() is not None:
                raise
            raise EngineRejected(f"vLLM refused request {request_id!r}: {error}") from error
        live.admitted = True
        return collector

    async def _generate(self, engine: Any, prompt: list[int], params: Any, request_id: str,
                        live: _Live) -> Any:
        collector = await self._admit(engine, prompt, params, request_id, live)
        try:
            if live.aborted:  # the abort came while vLLM was admitting it
                await engine.abort(request_id)
            while True:
                output = collector.get_nowait() or await collector.get()
                if output.finished:
                    return output
        except asyncio.CancelledError:
            await engine.abort(request_id)
            raise
        finally:
            collector.close()

    async def _outputs(self, engine: Any, prompt: list[int], params: Any, request_id: str,
                       live: _Live) -> AsyncIterator[Any]:
        """Every output vLLM hands out for the request, until the finished one. A consumer
        that stops early (the client left) aborts the request."""
        collector = await self._admit(engine, prompt, params, request_id, live)
        finished = False
        try:
            if live.aborted:
                await engine.abort(request_id)
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:  # cancelled, or the generator was closed mid-way
                await engine.abort(request_id)
            collector.close()


def serving_usage_context() -> Any:
    """The usage context the engine is built in: vLLM's OpenAI server's. vLLM picks its batch
    limits (``max_num_seqs``, ``max_num_batched_tokens``) by context and device; a bare
    ``AsyncLLM`` gets 128 sequences and 2,048 tokens a step where ``vllm serve`` on an H200 gets
    1,024 and 8,192. Measured there, 256 concurrent clients: the smaller limits queued half of
    them (time to first token 2.2x vLLM's server's). The fleet serves OpenAI requests, so it
    takes the server's limits; ``max_num_seqs`` in the config still overrides."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def _build_engine(config: VllmEngineConfig) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = config.engine_kwargs()
    if "kv_events_config" in kwargs:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    if "weight_transfer_config" in kwargs:
        from vllm.config import WeightTransferConfig

        kwargs["weight_transfer_config"] = WeightTransferConfig(**kwargs["weight_transfer_config"])
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=serving_usage_context())


