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
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.adapters.shared.shm import SharedMemoryTracker
from rollout_fleet.adapters.vllm.config import KV_EVENTS_TOPIC, VllmEngineConfig, precision_env
from rollout_fleet.adapters.vllm.features import VllmFeatures, detect_features
from rollout_fleet.adapters.vllm.weights import checkpoint_metas, tied_metas
from rollout_fleet.core.errors import (
    EngineDead, EngineError, EngineRejected, InvalidValue, RefitError, WeightMismatch,
)
from rollout_fleet.core.refit import (
    DEFAULT_REFIT_MODE,
    PACKED_PROTOCOL,
    GroupJoin,
    RefitInfo,
    TensorMeta,
    next_version,
    refit_mode,
)
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout, Usage
from rollout_fleet.ports.engine import (
    SAMPLING_OPTIONS,
    EngineFacts,
    EnginePort,
    KvEventSource,
    RefitTarget,
    RolloutPiece,
)

log = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
                   "abort": FinishReason.ABORT}
_EARLY_ABORTS_KEPT = 4096
_SHUTDOWN_TIMEOUT_S = 30.0
_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


@attrs.define
class _Live:
    """One rollout this adapter is serving."""

    admitted: bool = False  # vLLM knows the request id: an abort can go straight to it
    aborted: bool = False


class VllmEngine(EnginePort, RefitTarget):
    """The vLLM backend of a rollout-fleet worker."""

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
                self._track_segments(self._engine_processes)
                if self.config.device == "cpu" and self.config.cpu_worker_nice is not None:
                    _set_worker_priority(self.config.cpu_worker_nice, self._engine_processes)
                await self._label_weight_version()
                self._facts = _read_facts(self._engine)
                folder = self._engine.model_config.model
                self._metas = checkpoint_metas(folder, _engine_dtype(self._engine))
                self._ignored = tied_metas(folder, self._metas)
                # As vLLM's own server does after init: the millions of objects that importing
                # and building the engine left behind go to the permanent generation, else
                # every full collection scans them (0.2-0.5 s with the loop and GIL held, here).
                gc.collect()
                gc.freeze()
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
                             stop_strings: Sequence[str] = (), top_logprobs: int = 0,
                             stop_token_ids: Sequence[int] = (),
                             extra_sampling: Mapping[str, Any] | None = None
                             ) -> AsyncIterator[RolloutPiece]:
        """A piece per engine step, as vLLM hands out each step's new tokens (its DELTA
        outputs)."""
        engine = self._require_engine()
        prompt = self._admissible(prompt_token_ids, max_new_tokens, stop_token_ids, extra_sampling)
        if self._early_aborts.pop(request_id, "absent") is None:
            yield RolloutPiece((), (), FinishReason.ABORT)
            return
        params = _sampling_params(sampling, max_new_tokens, stop_strings, top_logprobs,
                                  stop_token_ids, extra_sampling, stream=True)
        live = self._live[request_id] = _Live()
        try:
            async with contextlib.aclosing(self._outputs(engine, prompt, params, request_id,
                                                         live)) as outputs:
                async for output in outputs:  # closed at once if our consumer stops early
                    yield _piece_of(output, top_logprobs)
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

    # -- refit port ---------------------------------------------------------------------------
    def weight_metas(self) -> Mapping[str, TensorMeta]:
        self._require_engine()
        return {**self._ignored, **self._metas}

    def refit_ranks(self) -> int:
        return self.config.refit_ranks

    async def init_collective(self, join: GroupJoin) -> None:
        """Every engine rank's weight-transfer engine joins the group (vLLM runs the call in
        each of its workers; the engine core waits for them, bounded by the join's timeout)."""
        engine = self._require_engine()
        if join.ranks_per_worker != self.refit_ranks():
            raise InvalidValue("ranks_per_worker", join.ranks_per_worker,
                               f"this engine has tensor_parallel_size x pipeline_parallel_size ="
                               f" {self.refit_ranks()} ranks")
        if join.sender_spec.protocol != self.config.refit_protocol:
            raise InvalidValue("sender_spec.protocol", join.sender_spec.protocol,
                               "this worker's vLLM engine receives refits in"
                               f" {self.config.refit_protocol!r} (its refit_protocol, fixed when"
                               " the engine starts)")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        async with self._weight_lock:
            self._joined = False
            try:
                await engine.init_weight_transfer_engine(
                    WeightTransferInitRequest(init_info=self._init_info(join)))
            except Exception as error:
                raise RefitError(f"joining the refit group at {join.host}:{join.port} failed:"
                                 f" {_first_line(error)}") from error
            self._joined = True

    async def update_weights(self, info: RefitInfo, *, mode: str = DEFAULT_REFIT_MODE,
                             version: int | None = None) -> int:
        """Pause (``mode``: drain, keep or recompute), receive and load inside vLLM's workers,
        reset the prefix cache as the mode says, resume."""
        mode = refit_mode(mode)
        engine = self._require_engine()
        if mode not in self._features.refit_modes:
            raise InvalidValue("mode", mode, "this vLLM labels no token with the weights it was"
                               " sampled under (CompletionOutput.weight_versions): only"
                               f" {', '.join(self._features.refit_modes)} keeps labels exact")
        if not self._joined:
            raise RefitError("update_weights before init_collective")
        _check_complete(info, self._metas, self._ignored)
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._weight_lock, _paused(engine, mode), self._refit_priority():
            started = time.perf_counter()
            try:
                await engine.start_weight_update()
                await engine.update_weights(WeightTransferUpdateRequest(
                    update_info=self._update_info(info)))
                await engine.finish_weight_update()
            except Exception as error:
                self._joined = False  # the group broke: the next refit forms a new one
                await self._note_failed_refit()
                raise RefitError(f"the refit failed inside vLLM: {_first_line(error)}"
                                 + ("; weights torn, rollouts refused until a refit succeeds"
                                    if self._torn else "; the previous weights serve")) from error
            loaded = time.perf_counter()
            self._torn = None
            version = await self._commit_new_weights(mode, version)
        reset = time.perf_counter()
        ranks = await self._engine.collective_rpc("rollout_fleet_refit_stats")
        log.info("weights v%d: %d tensors, %.0f MiB received and loaded in %.3f s (per rank: %s),"
                 " cache reset %.3f s", version, len(info.tensors), info.total_bytes / 2**20,
                 loaded - started, ", ".join(
                     f"{rank.get('seconds', 0):.3f} s, {rank.get('waiting_s', 0):.3f} s waiting"
                     " for the wire" + _cuda_memory_text(rank) for rank in ranks), reset - loaded)
        return version

    def weight_version(self) -> int:
        return self._version

    async def reset_cache(self) -> None:
        engine = self._require_engine()
        if await engine.reset_prefix_cache():
            self._kv_salt = None  # nothing cached is left from older weights
            return
        # Running requests still hold blocks: preempt them (they recompute), then reset.
        if not await engine.reset_prefix_cache(reset_running_requests=True):
            raise EngineError("vLLM refused to reset its prefix cache")
        self._kv_salt = None

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
        gc.unfreeze()  # start() froze the engine's objects; a frozen cycle is never collected
        gc.collect()  # collect it now: a late __del__ at interpreter exit would shut down twice
        endpoint = self.config.kv_events_endpoint or ""
        if endpoint.startswith("ipc://"):  # the KV-event socket's file outlives its socket
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoint[len("ipc://"):])
        # An engine core that was killed, or outlived the shutdown timeout, leaves its queues.
        for tracker in self._segments:
            tracker.remove_all()
        self._segments = []

    def _track_segments(self, engine_processes: set[int]) -> None:
        """Record the /dev/shm queues of the engine core(s) just started and their workers."""
        self._segments = [SharedMemoryTracker(pid, remove_unused=False) for pid in sorted(engine_processes)]
        for tracker in self._segments:
            tracker.scan()

    # -- internals ----------------------------------------------------------------------------
    def _require_engine(self) -> Any:
        if self._engine is None:
            raise EngineError("the vLLM engine is not started: call start() first")
        return self._engine

    @contextlib.asynccontextmanager
    async def _refit_priority(self):
        """On the CPU vLLM's processes run niced (they busy-poll between steps), but a refit is
        received inside them now: at nice 10 on a busy host the receive waited for cores (a
        200 MiB refit took 1-8 s against 0.2 s for the flat broadcast). Normal priority while
        the refit runs; niced again after."""
        nice = self.config.cpu_worker_nice if self.config.device == "cpu" else None
        if not nice:
            yield
            return
        _set_worker_priority(0, self._engine_processes)
        try:
            yield
        finally:
            _set_worker_priority(nice, self._engine_processes)

    def _init_info(self, join: GroupJoin) -> dict[str, Any]:
        if self.config.refit_protocol == PACKED_PROTOCOL:
            return {"join": join.to_wire(), "rollback": self.config.rollback}
        return native_init_info(join)

    def _update_info(self, info: RefitInfo) -> dict[str, Any]:
        if self.config.refit_protocol == PACKED_PROTOCOL:
            sent = {t.name for t in info.tensors}
            return {"refit_info": info.to_wire(), "skip": sorted(sent & set(self._ignored))}
        return native_update_info(info)

    async def _note_failed_refit(self) -> None:
        """Ask every engine rank how its failed refit ended: rolled back, or torn."""
        try:
            stats = await self._engine.collective_rpc("rollout_fleet_refit_stats")
        except Exception as error:  # the engine is in trouble; refuse rollouts to be safe
            self._torn = f"its refit state is unknown: {_first_line(error)}"
            return
        if any(rank.get("torn", True) for rank in stats):
            self._torn = "a refit failed half way and no copy of the previous weights was kept"

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

    async def _commit_new_weights(self, mode: str = DEFAULT_REFIT_MODE,
                                  version: int | None = None) -> int:
        """Still paused: drop the cache as ``mode`` says, and label every token from now on
        with the new version."""
        if mode == "keep":
            await self._keep_running_kv()
        else:  # drained: nothing runs; recompute: running rollouts are preempted and recompute
            await self.reset_cache()
        self._version = next_version(self._version, version)
        await self._label_weight_version()
        return self._version

    async def _label_weight_version(self) -> None:
        """Tell vLLM the version to label tokens with, where it has per-engine versions; an
        older vLLM has none and the adapter's count alone is the version (features.py)."""
        if self._features.per_engine_versions:
            await self._engine.update_weight_version(str(self._version))

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

    async def _keep_running_kv(self) -> None:
        """Keep mode: the rollouts in flight keep the KV they hold. vLLM resets its prefix cache
        only when no block is in use; when some are, new rollouts get a cache salt of the new
        version instead, so none of them reuses a block computed by older weights."""
        if await self._engine.reset_prefix_cache():
            self._kv_salt = None
        else:
            self._kv_salt = f"rollout-fleet-weights-v{self._version + 1}"

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


async def _in_thread(function: Any, *args: Any) -> Any:
    """Run a blocking call in a thread of its own, keeping no reference to its result or its
    function afterwards: anything left holding the vLLM engine keeps it alive past ``close``,
    and its late ``__del__`` then runs a second shutdown while the interpreter exits."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    outcome: list[tuple[Any, BaseException | None]] = []  # emptied by the loop, not the thread

    def run() -> None:
        try:
            outcome.append((function(*args), None))
        except BaseException as error:  # handed to the awaiting coroutine
            outcome.append((None, error))
        loop.call_soon_threadsafe(_settle, future, outcome)

    threading.Thread(target=run, name="vllm-blocking-call", daemon=True).start()
    try:
        return await future
    finally:
        future = function = args = None  # the thread's closure cells let go too


def _settle(future: asyncio.Future, outcome: list) -> None:
    result, error = outcome.pop()
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


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
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))


@contextlib.contextmanager
def _cpu_binding(config: VllmEngineConfig):
    """While the engine starts, tell vLLM which cores to bind its model threads to: its
    engine-core process reads the variable from the environment it inherits."""
    binding = config.cpu_binding(sorted(os.sched_getaffinity(0))) if config.device == "cpu" else None
    if binding is None:
        yield
        return
    before = os.environ.get(_OMP_BIND)
    os.environ[_OMP_BIND] = binding
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_OMP_BIND, None)
        else:
            os.environ[_OMP_BIND] = before


@contextlib.contextmanager
def _environment(values: Mapping[str, str]):
    """Set ``values`` in this process's environment while vLLM starts: its engine core and
    workers inherit them."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _child_pids() -> set[int]:
    """This process's children; those that appear while the engine starts are vLLM's engine
    core(s). Found by place, not by their ``VLLM::*`` titles (a title was missing in some
    runs); multiprocessing's resource tracker, started on first use, is not vLLM's."""
    import psutil

    return {child.pid for child in psutil.Process().children() if not _resource_tracker(child)}


def _resource_tracker(process: Any) -> bool:
    import psutil

    try:
        return any("resource_tracker" in part for part in process.cmdline())
    except psutil.Error:
        return False


def _set_worker_priority(nice: int, engine_processes: Collection[int]) -> int:
    """Set ``nice`` on every thread of vLLM's engine-core processes and of every process under
    them (the model workers); threads they start later inherit it. Both busy-poll their
    shared-memory queues: lowering only one lets the other's polling take its core. Raising a
    priority back needs the right to (root, or CAP_SYS_NICE); without it the threads keep
    their nice. Returns the threads changed."""
    import psutil

    changed = 0
    for pid in engine_processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            for process in (root, *root.children(recursive=True)):
                if _resource_tracker(process):
                    continue
                with contextlib.suppress(psutil.NoSuchProcess):
                    for thread in process.threads():
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.setpriority(os.PRIO_PROCESS, thread.id, nice)  # one thread's
                            changed += 1
    if not changed:
        log.warning("could not set any vLLM process to nice %d", nice)
    return changed


def _read_facts(engine: Any) -> EngineFacts:
    config = engine.vllm_config
    return EngineFacts(
        context_length=config.model_config.max_model_len,
        kv_block_size=config.cache_config.block_size,
        total_kv_blocks=config.cache_config.num_gpu_blocks,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
    )


# vLLM's pause modes: "wait" lets the requests in flight finish first; "keep" freezes them in
# the scheduler, where they stay (KV included) until generation resumes.
_VLLM_PAUSE = {"drain": "wait", "keep": "keep", "recompute": "keep"}


@contextlib.asynccontextmanager
async def _paused(engine: Any, mode: str = DEFAULT_REFIT_MODE):
    """Hold new requests, drain or freeze those in flight (``mode``), and always resume (even
    on a failed load)."""
    await engine.pause_generation(mode=_VLLM_PAUSE[mode], clear_cache=False)
    try:
        yield
    finally:
        await engine.resume_generation()


def _engine_dtype(engine: Any) -> str:
    return str(engine.model_config.dtype).removeprefix("torch.")


def _sampling_params(sampling: SamplingSpec, max_new_tokens: int, stop_strings: Sequence[str],
                     top_logprobs: int = 0, stop_token_ids: Sequence[int] = (),
                     extra: Mapping[str, Any] | None = None, stream: bool = False) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    common = dict(max_tokens=max_new_tokens, logprobs=top_logprobs, stop=list(stop_strings) or None,
                  stop_token_ids=list(stop_token_ids) or None,
                  detokenize=bool(stop_strings),  # text is only needed to find stop strings
                  output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                  # Built for this one request and never reused: vLLM may take it as it is
                  # instead of deep-copying it (measured: ~6% of the worker host's main thread).
                  skip_clone=True, **(extra or {}))
    if sampling.greedy:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=0 if sampling.top_k == -1 else sampling.top_k,
                          seed=sampling.seed, **common)


def _piece_of(output: Any, top_n: int = 0) -> RolloutPiece:
    """One DELTA output: the step's new tokens with their logprobs (and alternatives)."""
    completion = output.outputs[0]
    token_ids = tuple(completion.token_ids)
    steps = completion.logprobs or []
    if len(steps) != len(token_ids):
        raise EngineError(f"vLLM returned {len(token_ids)} tokens but {len(steps)} logprobs "
                          f"for request {output.request_id!r}")
    reason = None
    if output.finished:
        reason = _FINISH_REASONS.get(completion.finish_reason)
        if reason is None:
            raise EngineError(f"vLLM ended request {output.request_id!r} with finish_reason="
                              f"{completion.finish_reason!r}")
    return RolloutPiece(token_ids, tuple(step[token].logprob for step, token in zip(steps, token_ids)),
                        reason, tuple(_top_of(step, top_n) for step in steps) if top_n else None)


def _to_served(output: Any, prompt_len: int, version: int, top_n: int = 0) -> ServedRollout:
    completion = output.outputs[0]
    reason = _FINISH_REASONS.get(completion.finish_reason)
    if reason is None:
        raise EngineError(f"vLLM ended request {output.request_id!r} with finish_reason="
                          f"{completion.finish_reason!r}")
    token_ids = list(completion.token_ids)
    logprobs = completion.logprobs or []
    if len(logprobs) != len(token_ids):
        raise EngineError(f"vLLM returned {len(token_ids)} tokens but {len(logprobs)} logprobs "
                          f"for request {output.request_id!r}")
    chosen = [step[token].logprob for step, token in zip(logprobs, token_ids)]
    # Each step also holds the top_n most likely tokens (ranks 1..top_n; the chosen one may
    # rank lower and is in ``chosen``).
    tops = tuple(_top_of(step, top_n) for step in logprobs) if top_n else None
    # An older vLLM has no per-token versions: every token is tagged with ``version``, exact
    # because such an engine accepts drain refits only (features.py).
    return _served(token_ids, chosen, reason, prompt_len, version, tops,
                   _version_runs(getattr(completion, "weight_versions", None), len(token_ids), version))


def _top_of(step: Mapping[int, Any], top_n: int) -> tuple[tuple[int, float], ...]:
    ranked = sorted((entry.rank, token, entry.logprob) for token, entry in step.items()
                    if entry.rank is not None and entry.rank <= top_n)
    return tuple((token, logprob) for _rank, token, logprob in ranked)


def _version_runs(spans: Any, n_tokens: int, version: int) -> list[tuple[int, int]]:
    """vLLM's spans (``version`` label, ``[start, end)`` of the output tokens) as runs; without
    spans (no token carried a label) every token is tagged with the version at completion."""
    if not spans:
        return [(version, n_tokens)] if n_tokens else []
    runs = [(int(span.version), span.end - span.start) for span in spans if span.end > span.start]
    if sum(n for _, n in runs) != n_tokens:
        raise EngineError(f"vLLM's weight-version spans {spans} do not cover {n_tokens} tokens")
    return runs


def _served(token_ids, logprobs, reason, prompt_len, version, tops=None, runs=None) -> ServedRollout:
    return ServedRollout(token_ids, logprobs, reason, Usage(prompt_len, len(token_ids)),
                         weight_version=version, top_logprobs=tops,
                         **({} if runs is None else {"weight_versions": runs}))


def native_init_info(join: GroupJoin) -> dict[str, Any]:
    """vLLM's ``nccl`` engine's init request for a join: vLLM's own layout (the trainer's
    rank 0 alone, then each worker's ranks from ``rank_offset``) and packed geometry."""
    return {"master_address": join.host, "master_port": join.port, "rank_offset": join.first_rank,
            "world_size": join.world_size, "packed": True,
            "packed_buffer_size_bytes": join.sender_spec.buffer_bytes,
            "packed_num_buffers": join.sender_spec.num_buffers}


def native_update_info(info: RefitInfo) -> dict[str, Any]:
    """vLLM's ``nccl`` engine's update request: names, dtype names and shapes, in wire order."""
    return {"names": [t.name for t in info.tensors],
            "dtype_names": [t.dtype for t in info.tensors],
            "shapes": [list(t.shape) for t in info.tensors]}


def _cuda_memory_text(rank: Mapping[str, Any]) -> str:
    if rank.get("cuda_before", -1) < 0:
        return ""
    mib = {k: rank[k] / 2**20 for k in ("cuda_before", "cuda_peak", "cuda_after")}
    return (f", GPU memory allocated before {mib['cuda_before']:.1f} MiB, peak"
            f" {mib['cuda_peak']:.1f} MiB (+{mib['cuda_peak'] - mib['cuda_before']:.1f}),"
            f" after {mib['cuda_after']:.1f} MiB")


def _check_vocabulary(field: str, token_ids: Sequence[Any], vocab: int) -> None:
    """EngineRejected naming the first token ID outside the model's vocabulary, and its size."""
    for index, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise EngineRejected(f"{field}[{index}]={token!r} is outside the model's vocabulary of"
                                 f" {vocab} tokens (IDs 0..{vocab - 1})")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _check_complete(info: RefitInfo, metas: Mapping[str, TensorMeta],
                    ignored: Mapping[str, TensorMeta] = {}) -> None:  # noqa: B006 - read only
    """Every name, shape and dtype is the engine's, and every parameter is there: vLLM rebuilds
    each fused layer (q, k and v into ``qkv_proj``) from all its parts, and a layer refit in
    part would be left half empty. ``ignored`` names (a tied ``lm_head.weight``) may come or
    not: vLLM's loader skips them."""
    try:
        info.check_against({**ignored, **metas})
    except WeightMismatch:
        raise
    except InvalidValue as error:
        raise WeightMismatch(error.field, error.value, error.rule) from None
    missing = sorted(set(metas) - {t.name for t in info.tensors})
    if missing:
        raise WeightMismatch("tensor names", missing[:5], f"{len(missing)} of the engine's"
                             " parameters are missing: a refit carries every one")
