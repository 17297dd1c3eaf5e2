"""The vLLM engine's refit part (``VllmRefit``, the refit port of ``VllmEngine``) and what it
sends vLLM for a refit: the project's messages (``adapters/vllm/messages.py``) or the requests
of vLLM's own ``nccl`` weight-transfer engine, and the text of what each engine rank reports."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from rollout_fleet.adapters.shared.errors import first_line
from rollout_fleet.adapters.vllm.host.runtime import VllmRuntime
from rollout_fleet.adapters.vllm.host.weights import check_complete
from rollout_fleet.adapters.vllm.messages import (
    REFIT_STATS_RPC, PackedInitInfo, PackedUpdateInfo, RefitInfoOnce, RefitStats,
)
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import (
    DEFAULT_REFIT_MODE, GroupJoin, RefitInfo, RefitMode, RefitProtocol, TensorMeta,
)
from rollout_fleet.ports.engine import RefitTarget

log = logging.getLogger(__name__)
PROJECT_PROTOCOLS = (RefitProtocol.PACKED, RefitProtocol.SHARDED)  # received by the project's engines


class VllmRefit(RefitTarget):
    """The refit port of ``VllmEngine``: joins the trainer's group (it keeps whether it is
    joined, and the refit info the group's ranks hold) and loads refits into the engine of
    ``runtime``, committing them through its weights' standing under the weight lock."""

    def __init__(self, runtime: VllmRuntime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self._joined = False
        self._sent = RefitInfoOnce()  # the refit info the engine's ranks hold
        self._complete: RefitInfo | None = None  # the last refit info found complete

    def weight_metas(self) -> Mapping[str, TensorMeta]:
        return self.runtime.weight_metas()

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
            self._sent.forget()  # a new group: its first refit carries the info
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
        modes = self.runtime.require_features().refit_modes
        if mode not in modes:
            raise InvalidValue("mode", mode, "this vLLM labels no token with the weights it was"
                               " sampled under (CompletionOutput.weight_versions): only"
                               f" {', '.join(modes)} keeps labels exact")
        if not self._joined:
            raise RefitError("update_weights before init_collective")
        self._check_complete(info)
        standing = self.runtime.standing
        standing.check_refit_allowed()  # the weights' memory must be back (wake_up)
        async with self.runtime.weight_lock, self.runtime.paused_for_refit(engine, mode):
            started = time.perf_counter()
            try:
                await self._load(engine, info)
            except asyncio.CancelledError:
                # Abandoned at its deadline: vLLM's ranks may still be loading, so this worker
                # serves nothing until a refit succeeds rather than a half-loaded model.
                self._left_group()
                standing.health.mark_torn("a refit was abandoned at its deadline while vLLM"
                                          " loaded it")
                raise
            except Exception as error:
                self._left_group()  # the group broke: the next refit forms a new one
                await standing.note_failed_refit(engine)
                raise RefitError(f"the refit failed inside vLLM: {first_line(error)}"
                                 + ("; weights torn, rollouts refused until a refit succeeds"
                                    if standing.health.torn else "; the previous weights serve")
                                 ) from error
            loaded = time.perf_counter()
            version = await standing.commit(engine, mode, version)
        reset = time.perf_counter()
        ranks = [RefitStats.from_wire(rank) for rank in await engine.collective_rpc(REFIT_STATS_RPC)]
        log.info("weights v%d: %d tensors, %.0f MiB received and loaded in %.3f s (per rank: %s),"
                 " cache reset %.3f s", version, len(info.tensors), info.total_bytes / 2**20,
                 loaded - started, ", ".join(
                     f"{rank.seconds:.3f} s, {rank.waiting_s:.3f} s waiting for the wire"
                     + _cuda_memory_text(rank) for rank in ranks), reset - loaded)
        return version

    async def _load(self, engine: Any, info: RefitInfo) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(
            update_info=self._update_info(info)))
        await engine.finish_weight_update()

    def _check_complete(self, info: RefitInfo) -> None:
        """``weights.check_complete``, once per refit info: the engine's parameters never
        change, and a trainer sends the same info refit after refit."""
        if info != self._complete:
            check_complete(info, self.runtime.metas, self.runtime.ignored)
            self._complete = info

    def _left_group(self) -> None:
        self._joined = False
        self._sent.forget()

    def weight_version(self) -> int:
        return self.runtime.standing.version

    async def reset_cache(self) -> None:
        await self.runtime.standing.reset_cache(self.runtime.require_engine())

    def _init_info(self, join: GroupJoin) -> dict[str, Any]:
        if self.config.refit_protocol in PROJECT_PROTOCOLS:
            return PackedInitInfo(join, self.config.rollback).to_wire()
        return native_init_info(join)

    def _update_info(self, info: RefitInfo) -> dict[str, Any]:
        if self.config.refit_protocol in PROJECT_PROTOCOLS:
            skip = {t.name for t in info.tensors} & set(self.runtime.ignored)
            return PackedUpdateInfo(self._sent.outgoing(info), tuple(sorted(skip))).to_wire()
        return native_update_info(info)


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


def _cuda_memory_text(rank: RefitStats) -> str:
    if rank.cuda_before < 0:
        return ""
    mib = {k: getattr(rank, k) / 2**20 for k in ("cuda_before", "cuda_peak", "cuda_after")}
    return (f", GPU memory allocated before {mib['cuda_before']:.1f} MiB, peak"
            f" {mib['cuda_peak']:.1f} MiB (+{mib['cuda_peak'] - mib['cuda_before']:.1f}),"
            f" after {mib['cuda_after']:.1f} MiB")
