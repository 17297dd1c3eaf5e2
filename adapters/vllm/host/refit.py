"""The vLLM engine's refit part (``VllmRefit``, the refit port of ``VllmEngine``) and what it
sends vLLM for a refit and checks before: vLLM's pause around the load, the requests of vLLM's
own ``nccl`` weight-transfer engine, the check that a refit carries every parameter, and the
text of what each engine rank reports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from rollout_fleet.adapters.vllm.host.process import refit_priority
from rollout_fleet.adapters.vllm.host.runtime import VllmRuntime
from rollout_fleet.adapters.vllm.messages import REFIT_STATS_RPC, PackedInitInfo, PackedUpdateInfo
from rollout_fleet.core.errors import EngineError, InvalidValue, RefitError, WeightMismatch
from rollout_fleet.core.refit import (
    DEFAULT_REFIT_MODE,
    GroupJoin,
    RefitInfo,
    RefitMode,
    RefitProtocol,
    TensorMeta,
    next_version,
)
from rollout_fleet.ports.engine import RefitTarget

log = logging.getLogger(__name__)
PROJECT_PROTOCOLS = (RefitProtocol.PACKED, RefitProtocol.SHARDED)  # received by the project's engines


class VllmRefit(RefitTarget):
    """The refit port of ``VllmEngine``: joins the trainer's group (it keeps whether it is
    joined) and loads refits into the engine of ``runtime``, whose weights' standing (version,
    cache salt, torn) it updates under the runtime's weight lock."""

    def __init__(self, runtime: VllmRuntime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self._joined = False

    def weight_metas(self) -> Mapping[str, TensorMeta]:
        self.runtime.require_engine()
        return {**self.runtime.ignored, **self.runtime.metas}

    def refit_ranks(self) -> int:
        return self.config.refit_ranks

    async def init_collective(self, join: GroupJoin) -> None:
        """Every engine rank's weight-transfer engine joins the group (vLLM runs the call in
        each of its workers; the engine core waits for them, bounded by the join's timeout)."""
        engine = self.runtime.require_engine()
        if join.ranks_per_worker != self.refit_ranks():
            raise InvalidValue("ranks_per_worker", join.ranks_per_worker,
                               f"this engine has tensor_parallel_size x pipeline_parallel_size ="
                               f" {self.refit_ranks()} ranks")
        if join.sender_spec.protocol is not self.config.refit_protocol:
            raise InvalidValue("sender_spec.protocol", join.sender_spec.protocol.value,
                               "this worker's vLLM engine receives refits in"
                               f" {self.config.refit_protocol.value!r} (its refit_protocol, fixed when"
                               " the engine starts)")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        async with self.runtime.weight_lock:
            self._joined = False
            try:
                await engine.init_weight_transfer_engine(
                    WeightTransferInitRequest(init_info=self._init_info(join)))
            except Exception as error:
                raise RefitError(f"joining the refit group at {join.host}:{join.port} failed:"
                                 f" {first_line(error)}") from error
            self._joined = True

    async def update_weights(self, info: RefitInfo, *, mode: RefitMode = DEFAULT_REFIT_MODE,
                             version: int | None = None) -> int:
        """Pause (``mode``: drain, keep or recompute), receive and load inside vLLM's workers,
        reset the prefix cache as the mode says, resume."""
        engine = self.runtime.require_engine()
        if mode not in self.runtime.features.refit_modes:
            raise InvalidValue("mode", mode, "this vLLM labels no token with the weights it was"
                               " sampled under (CompletionOutput.weight_versions): only"
                               f" {', '.join(self.runtime.features.refit_modes)} keeps labels exact")
        if not self._joined:
            raise RefitError("update_weights before init_collective")
        check_complete(info, self.runtime.metas, self.runtime.ignored)
        self.runtime.sleep.check_refit_allowed()  # the weights' memory must be back (wake_up)
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with (self.runtime.weight_lock, paused_for_refit(engine, mode),
                    refit_priority(self.config, self.runtime.processes)):
            started = time.perf_counter()
            try:
                await engine.start_weight_update()
                await engine.update_weights(WeightTransferUpdateRequest(
                    update_info=self._update_info(info)))
                await engine.finish_weight_update()
            except asyncio.CancelledError:
                # Abandoned at its deadline: vLLM's ranks may still be loading, so this worker
                # serves nothing until a refit succeeds rather than a half-loaded model.
                self._joined = False
                self.runtime.torn = "a refit was abandoned at its deadline while vLLM loaded it"
                raise
            except Exception as error:
                self._joined = False  # the group broke: the next refit forms a new one
                await self.note_failed_refit()
                raise RefitError(f"the refit failed inside vLLM: {first_line(error)}"
                                 + ("; weights torn, rollouts refused until a refit succeeds"
                                    if self.runtime.torn else "; the previous weights serve")) from error
            loaded = time.perf_counter()
            self.runtime.torn = None
            self.runtime.sleep.refit_loaded()  # weights dropped by a level-2 sleep are loaded again
            version = await self.commit_new_weights(mode, version)
        reset = time.perf_counter()
        ranks = await self.runtime.engine.collective_rpc(REFIT_STATS_RPC)
        log.info("weights v%d: %d tensors, %.0f MiB received and loaded in %.3f s (per rank: %s),"
                 " cache reset %.3f s", version, len(info.tensors), info.total_bytes / 2**20,
                 loaded - started, ", ".join(
                     f"{rank.get('seconds', 0):.3f} s, {rank.get('waiting_s', 0):.3f} s waiting"
                     " for the wire" + _cuda_memory_text(rank) for rank in ranks), reset - loaded)
        return version

    def weight_version(self) -> int:
        return self.runtime.version

    async def reset_cache(self) -> None:
        engine = self.runtime.require_engine()
        if await engine.reset_prefix_cache():
            self.runtime.kv_salt = None  # nothing cached is left from older weights
            return
        # Running requests still hold blocks: preempt them (they recompute), then reset.
        if not await engine.reset_prefix_cache(reset_running_requests=True):
            raise EngineError("vLLM refused to reset its prefix cache")
        self.runtime.kv_salt = None

    def _init_info(self, join: GroupJoin) -> dict[str, Any]:
        if self.config.refit_protocol in PROJECT_PROTOCOLS:
            return PackedInitInfo(join, self.config.rollback).to_wire()
        return native_init_info(join)

    def _update_info(self, info: RefitInfo) -> dict[str, Any]:
        if self.config.refit_protocol in PROJECT_PROTOCOLS:
            sent = {t.name for t in info.tensors}
            return PackedUpdateInfo(info, tuple(sorted(sent & set(self.runtime.ignored)))).to_wire()
        return native_update_info(info)

    async def note_failed_refit(self) -> None:
        """Ask every engine rank how its failed refit ended: rolled back, or torn."""
        try:
            stats = await self.runtime.engine.collective_rpc(REFIT_STATS_RPC)
        except Exception as error:  # the engine is in trouble; refuse rollouts to be safe
            self.runtime.torn = f"its refit state is unknown: {first_line(error)}"
            return
        if any(rank.get("torn", True) for rank in stats):
            self.runtime.torn = ("a refit failed half way and no copy of the previous weights"
                                 " was kept")

    async def commit_new_weights(self, mode: str = DEFAULT_REFIT_MODE,
                                  version: int | None = None) -> int:
        """Still paused: drop the cache as ``mode`` says, and label every token from now on
        with the new version."""
        if mode == "keep":
            await self._keep_running_kv()
        else:  # drained: nothing runs; recompute: running rollouts are preempted and recompute
            await self.reset_cache()
        self.runtime.version = next_version(self.runtime.version, version)
        await self.runtime.label_weight_version()
        return self.runtime.version

    async def _keep_running_kv(self) -> None:
        """Keep mode: the rollouts in flight keep the KV they hold. vLLM resets its prefix cache
        only when no block is in use; when some are, new rollouts get a cache salt of the new
        version instead, so none of them reuses a block computed by older weights."""
        if await self.runtime.engine.reset_prefix_cache():
            self.runtime.kv_salt = None
        else:
            self.runtime.kv_salt = f"rollout-fleet-weights-v{self.runtime.version + 1}"



# vLLM's pause modes: "wait" lets the requests in flight finish first; "keep" freezes them in
# the scheduler, where they stay (KV included) until generation resumes.
_VLLM_PAUSE = {"drain": "wait", "keep": "keep", "recompute": "keep"}


@contextlib.asynccontextmanager
async def paused_for_refit(engine: Any, mode: str = DEFAULT_REFIT_MODE):
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
    processor = getattr(engine, "output_processor", None)
    core = getattr(engine, "engine_core", None)
    idle = callable(getattr(processor, "has_unfinished_requests", None)) and \
        not processor.has_unfinished_requests()
    if idle and callable(getattr(core, "pause_scheduler_async", None)):
        await core.pause_scheduler_async(mode=vllm_mode, clear_cache=False)
    else:
        await engine.pause_generation(mode=vllm_mode, clear_cache=False)


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


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def check_complete(info: RefitInfo, metas: Mapping[str, TensorMeta],
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
