"""VllmRuntime: one vLLM engine's life and what its parts read.

``VllmEngine`` is composed of parts (serving in ``engine.py``, refit in ``refit.py``, sleep in
``sleep.py``, colocated refit in ``colocated.py``, reload from disk in ``disk_reload.py``);
each keeps its own state and is handed this object for what they all read: the started
``AsyncLLM``, what it offers, its processes, its parameters, the weight lock no two weight
changes pass at once, and the parts that own the weights' standing (``standing``: version,
cache salt, torn or whole) and sleep (``sleep``). The runtime's own fields are written here
only, as the engine starts and closes.

Every kind of weight change (refit, colocated refit, reload from disk) takes the engine as a
whole the same way (``VllmRuntime.paused_for_refit``): vLLM paused as the refit mode says,
and its processes at normal priority. Those are the children that appear while the engine
starts (not multiprocessing's resource tracker); on the CPU they run niced (``nice``: they
busy-poll between steps, and on a small host that starves everything else), but a refit is
received inside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator, Collection, Mapping
from typing import Any

from rollout_fleet.adapters.shared.shm import SharedMemoryTracker
from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig, process_env
from rollout_fleet.adapters.vllm.host.convert import engine_dtype, read_facts
from rollout_fleet.adapters.vllm.host.features import VllmFeatures, detect_features
from rollout_fleet.adapters.vllm.host.process import (
    freeze_startup_objects, in_thread, ipc_environment, pinned_to_cpus, scoped_environment,
    track_segments, unfreeze_and_collect,
)
from rollout_fleet.adapters.vllm.host.standing import WeightsStanding
from rollout_fleet.adapters.vllm.host.weights import checkpoint_metas, tied_metas
from rollout_fleet.adapters.vllm.messages import PRECISION_RPC
from rollout_fleet.core.errors import EngineError
from rollout_fleet.core.refit import DEFAULT_REFIT_MODE, RefitMode, TensorMeta
from rollout_fleet.core.sleep import SleepTracker
from rollout_fleet.ports.engine import EngineFacts

log = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 30.0


class VllmRuntime:
    """The started engine, what it offers, and the parts its weights' standing lives in."""

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self.engine: Any = None  # vllm.v1.engine.async_llm.AsyncLLM, once started
        self.facts: EngineFacts | None = None
        self.features: VllmFeatures | None = None  # what this vLLM offers (features.py)
        self.processes: set[int] = set()  # what vLLM started under this process
        self.nice: int | None = None  # theirs between refits (none: their priority left alone)
        self.segments: list[SharedMemoryTracker] = []  # their /dev/shm queues
        self.metas: dict[str, TensorMeta] = {}  # the engine's parameters
        self.ignored: dict[str, TensorMeta] = {}  # refit may send; vLLM skips
        self.weight_lock = asyncio.Lock()  # refit, sleep and wake
        self.sleep = SleepTracker()
        self.standing = WeightsStanding(self.sleep)
        self.steps = 0  # engine-core outputs received: grows with every step (``progress``)
        self.ipc_folder: str | None = None  # vLLM's IPC socket files, the engine's own
        self._start_lock = asyncio.Lock()

    def require_engine(self) -> Any:
        if self.engine is None:
            raise EngineError("the vLLM engine is not started: call start() first")
        return self.engine

    def require_features(self) -> VllmFeatures:
        if self.features is None:
            raise EngineError("the vLLM engine is not started: call start() first")
        return self.features

    def require_facts(self) -> EngineFacts:
        if self.facts is None:
            raise EngineError("the vLLM engine is not started: call start() first")
        return self.facts

    @contextlib.asynccontextmanager
    async def paused_for_refit(self, engine: Any, mode: RefitMode = DEFAULT_REFIT_MODE
                               ) -> AsyncIterator[None]:
        """``engine`` (this runtime's) paused for a weight change as ``mode`` says, and always
        resumed after (``paused_for_refit``); meanwhile vLLM's processes at normal priority,
        niced again after (at nice 10 on a busy host the receive waited for cores: a 200 MiB
        refit took 1-8 s against 0.2 s for the flat broadcast)."""
        async with paused_for_refit(engine, mode):
            if not self.nice:
                yield
                return
            set_worker_priority(0, self.processes)
            try:
                yield
            finally:
                set_worker_priority(self.nice, self.processes)

    def weight_metas(self) -> Mapping[str, TensorMeta]:
        """What a refit may carry: the engine's parameters and the names vLLM skips."""
        self.require_engine()
        return {**self.ignored, **self.metas}

    async def start(self, worker_id: int | str) -> EngineFacts:
        async with self._start_lock:
            if self.engine is None:
                await self._build(worker_id)
        return self.require_facts()

    async def _build(self, worker_id: int | str) -> None:
        config = self.config
        # Building the engine blocks for ~20 s on a CPU (it spawns and waits for the engine
        # core); a thread keeps this loop answering meanwhile.
        children_before = child_pids()
        self.ipc_folder, ipc_env = ipc_environment()
        try:
            with pinned_to_cpus(config.omp_binding()), \
                    scoped_environment({**process_env(config), **ipc_env}):
                self.engine = await in_thread(build_async_llm, config)
        except BaseException:
            self._remove_ipc_folder()
            raise
        self.features = detect_features(self.engine)
        self.standing.labels_tokens(self.features.per_engine_versions)
        self.processes = child_pids() - children_before
        self._count_steps(self.engine)
        self.segments = track_segments(self.processes)
        self.nice = config.refit_nice
        if self.nice is not None:
            set_worker_priority(self.nice, self.processes)
        await self.standing.label(self.engine)
        self.facts = read_facts(self.engine)
        folder = self.engine.model_config.model
        self.metas = checkpoint_metas(folder, engine_dtype(self.engine))
        self.ignored = tied_metas(folder, self.metas)
        freeze_startup_objects()
        log.info("vLLM engine up for worker %s: %s; %s", worker_id, self.facts, self.features)
        await self._report_precision(worker_id)

    def _count_steps(self, engine: Any) -> None:
        """Count each batch of outputs vLLM's output loop takes from the engine core (one per
        step with work): a hung engine core sends none, so the count stands still."""
        core = engine.engine_core
        receive = core.get_output_async

        async def counted_receive():
            outputs = await receive()
            self.steps += 1
            return outputs

        core.get_output_async = counted_receive

    def dead_reason(self) -> str | None:
        """vLLM's engine core is gone (killed, crashed): this engine serves nothing more."""
        engine = self.engine
        if engine is None or not engine.errored:
            return None
        return f"vLLM's engine core died ({type(engine.dead_error).__name__})"

    async def _report_precision(self, worker_id: int | str) -> None:
        """Log, and print to the worker's output, what the engine serves in: the parameters'
        dtype and the float32 matmul precision of each engine rank."""
        ranks = await self.engine.collective_rpc(PRECISION_RPC)
        served = engine_dtype(self.engine)
        checkpoint = self.config.checkpoint_dtype()
        line = (f"worker {worker_id} serves dtype={served}"
                f" (checkpoint {checkpoint or 'unknown'}); per rank: "
                + "; ".join(", ".join(f"{k}={v}" for k, v in rank.items()) for rank in ranks))
        log.info("%s", line)
        print(line, flush=True)
        if checkpoint and checkpoint != served:
            log.warning("the checkpoint is %s but vLLM serves it in %s (engine.dtype=%r)",
                        checkpoint, served, self.config.dtype)

    async def close(self) -> None:
        """Stop vLLM's engine-core and worker processes; safe to call twice."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        for tracker in self.segments:  # what the engine core's processes use at the end
            tracker.scan()
        handler = engine.output_handler
        if handler is not None:  # first, or it reports the engine core's exit as an error
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        # Room for the engine core to finish its teardown: killed at vLLM's default 5 s (on a
        # busy host), it leaves its shared-memory queues behind in /dev/shm.
        await in_thread(engine.shutdown, _SHUTDOWN_TIMEOUT_S)
        del engine
        unfreeze_and_collect()
        endpoint = self.config.kv_events_endpoint or ""
        if endpoint.startswith("ipc://"):  # the KV-event socket's file outlives its socket
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoint[len("ipc://"):])
        # An engine core that was killed, or outlived the shutdown timeout, leaves its queues.
        for tracker in self.segments:
            tracker.remove_all()
        self.segments = []
        self._remove_ipc_folder()

    def _remove_ipc_folder(self) -> None:
        if self.ipc_folder is not None:
            shutil.rmtree(self.ipc_folder, ignore_errors=True)
            self.ipc_folder = None


def child_pids() -> set[int]:
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


def set_worker_priority(nice: int, engine_processes: Collection[int]) -> int:
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


# vLLM's pause modes: "wait" lets the requests in flight finish first; "keep" freezes them in
# the scheduler, where they stay (KV included) until generation resumes.
_VLLM_PAUSE = {RefitMode.DRAIN: "wait", RefitMode.KEEP: "keep", RefitMode.RECOMPUTE: "keep"}


@contextlib.asynccontextmanager
async def paused_for_refit(engine: Any, mode: RefitMode = DEFAULT_REFIT_MODE
                           ) -> AsyncIterator[None]:
    """Hold new requests, drain or freeze those in flight (``mode``), and always resume (even
    on a failed load)."""
    await _pause(engine, _VLLM_PAUSE[mode])
    try:
        yield
    finally:
        await engine.resume_generation()


async def _pause(engine: Any, vllm_mode: str) -> None:
    """vLLM's ``pause_generation``, less its fixed 20 ms sleep when nothing is in flight: that
    sleep only lets in-flight requests' last outputs through first, and an idle engine has none
    (it was most of a small model's refit). Busy, or without those parts: vLLM's own call."""
    has_unfinished = getattr(getattr(engine, "output_processor", None),
                             "has_unfinished_requests", None)
    pause_scheduler = getattr(getattr(engine, "engine_core", None), "pause_scheduler_async", None)
    if callable(has_unfinished) and callable(pause_scheduler) and not has_unfinished():
        await pause_scheduler(mode=vllm_mode, clear_cache=False)
    else:
        await engine.pause_generation(mode=vllm_mode, clear_cache=False)


def serving_usage_context() -> Any:
    """The usage context the engine is built in: vLLM's OpenAI server's. vLLM picks its batch
    limits (``max_num_seqs``, ``max_num_batched_tokens``) by context and device; a bare
    ``AsyncLLM`` gets 128 sequences and 2,048 tokens a step where ``vllm serve`` on an H200 gets
    1,024 and 8,192. Measured there, 256 concurrent clients: the smaller limits queued half of
    them (time to first token 2.2x vLLM's server's). The fleet serves OpenAI requests, so it
    takes the server's limits; ``max_num_seqs`` in the config still overrides."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def build_async_llm(config: VllmEngineConfig) -> Any:
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
