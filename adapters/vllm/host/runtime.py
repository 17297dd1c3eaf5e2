"""VllmRuntime: one vLLM engine's life and what its parts read.

``VllmEngine`` is composed of parts (serving in ``engine.py``, refit in ``refit.py``, sleep in
``sleep.py``, colocated refit in ``colocated.py``); each keeps its own state and is handed this
object for what they all read: the started ``AsyncLLM``, what it offers, its processes, its
parameters, the weight lock no two weight changes pass at once, and the parts that own the
weights' standing (``standing``: version, cache salt, torn or whole) and sleep (``sleep``).
The runtime's own fields are written here only, as the engine starts and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

from rollout_fleet.adapters.shared.shm import SharedMemoryTracker
from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig, precision_env
from rollout_fleet.adapters.vllm.host.convert import engine_dtype, read_facts
from rollout_fleet.adapters.vllm.host.features import VllmFeatures, detect_features
from rollout_fleet.adapters.vllm.host.process import (
    child_pids, freeze_startup_objects, in_thread, ipc_environment, pinned_to_cpus,
    scoped_environment, set_worker_priority, track_segments, unfreeze_and_collect,
)
from rollout_fleet.adapters.vllm.host.standing import WeightsStanding
from rollout_fleet.adapters.vllm.host.weights import checkpoint_metas, tied_metas
from rollout_fleet.adapters.vllm.messages import PRECISION_RPC
from rollout_fleet.core.device import Device
from rollout_fleet.core.errors import EngineError
from rollout_fleet.core.refit import TensorMeta
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
        self.segments: list[SharedMemoryTracker] = []  # their /dev/shm queues
        self.metas: dict[str, TensorMeta] = {}  # the engine's parameters
        self.ignored: dict[str, TensorMeta] = {}  # refit may send; vLLM skips
        self.weight_lock = asyncio.Lock()  # refit, sleep and wake
        self.standing = WeightsStanding(self._label_version)
        self.sleep = SleepTracker()
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
                    scoped_environment({**precision_env(config), **ipc_env}):
                self.engine = await in_thread(build_async_llm, config)
        except BaseException:
            self._remove_ipc_folder()
            raise
        self.features = detect_features(self.engine)
        self.processes = child_pids() - children_before
        self._count_steps(self.engine)
        self.segments = track_segments(self.processes)
        if config.device is Device.CPU and config.cpu_worker_nice is not None:
            set_worker_priority(config.cpu_worker_nice, self.processes)
        await self.label_weight_version()
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

    async def label_weight_version(self) -> None:
        """Tell vLLM the version to label tokens with (the standing's)."""
        await self._label_version(self.standing.version)

    async def _label_version(self, version: int) -> None:
        """Where vLLM has per-engine versions; an older vLLM has none and the adapter's count
        alone is the version (features.py)."""
        if self.require_features().per_engine_versions:
            await self.require_engine().update_weight_version(str(version))

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
