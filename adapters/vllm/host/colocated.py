"""The vLLM engine's side of the colocated refit (``ports.colocated.ColocatedTarget``).

The session spans several control calls: ``begin_colocated`` takes the engine's weight lock,
pauses generation as the mode says and starts vLLM's weight update; each bucket is one
``update_weights`` request, which the worker's transfer engine (``colocated_engine.py``) loads
straight out of the trainer's buffer; ``end_colocated`` finishes the update and commits it
with the same code as every refit (``WeightsStanding.commit``: prefix cache, version), then
resumes. ``abandon_colocated`` has the transfer engine recover (the last good weights, or torn)
and resumes. This host process only passes requests on; it never maps a buffer.

Tensor parallel 1 only: the trainer's buffers are on one device, the engine's one rank's. With
more ranks each lives on its own device and would need its own slice of every tensor from a
trainer rank on that device: that is the sharded protocol's plan, not a shared buffer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from rollout_fleet.adapters.shared.errors import first_line
from rollout_fleet.adapters.vllm.host.runtime import VllmRuntime
from rollout_fleet.adapters.vllm.host.weights import check_complete
from rollout_fleet.adapters.vllm.messages import (
    REFIT_STATS_RPC, RELEASE_BUFFERS_RPC, ColocatedBegin, ColocatedBucket, ColocatedStats,
    ColocatedUpdate, RefitInfoOnce,
)
from rollout_fleet.core.colocated_refit import (
    CUDA_TRANSPORT, SHM_TRANSPORT, BufferHandle, ColocatedManifest, ColocatedStep,
)
from rollout_fleet.core.device import Device
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import Bucket, RefitMode, RefitProtocol, TensorMeta
from rollout_fleet.ports.colocated import ColocatedTarget

COLOCATED_TP_RULE = ("a colocated refit hands the trainer's buffers to the one engine rank on"
                     " the trainer's device; with more ranks each lives on its own device and"
                     " needs its own slice of every tensor (the sharded protocol's job):"
                     " tensor parallel 1 only")


class VllmColocated(ColocatedTarget):
    """The colocated refit of the engine of ``runtime``: a session spans several calls (its
    stack: weight lock, pause, refit priority), and it commits through the weights' standing,
    as every refit does. It keeps the refit info the engine's rank holds."""

    def __init__(self, runtime: VllmRuntime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self._stack: contextlib.AsyncExitStack | None = None
        self._mode = RefitMode.DRAIN
        self._stats: dict[str, Any] = {}
        self._started = 0.0
        self._rank_failed = False  # a step raised inside vLLM: the rank ended the update
        self._sent = RefitInfoOnce()  # the refit info the engine's rank holds

    def weight_metas(self) -> Mapping[str, TensorMeta]:
        return self.runtime.weight_metas()

    def weight_version(self) -> int:
        return self.runtime.standing.version

    def colocated_transports(self) -> tuple[str, ...]:
        return (CUDA_TRANSPORT,) if self.config.device is Device.GPU else (SHM_TRANSPORT,)

    async def begin_colocated(self, manifest: ColocatedManifest, *, mode: RefitMode,
                              keep_buffers: bool = False) -> None:
        engine = self.runtime.require_engine()
        self._check_can_begin(manifest, mode)
        skip = {t.name for t in manifest.info.tensors} & set(self.runtime.ignored)
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.runtime.weight_lock)
        started = False
        try:
            await stack.enter_async_context(self.runtime.paused_for_refit(engine, mode))
            await engine.start_weight_update()
            started = True
            await self._request(ColocatedUpdate(ColocatedStep.BEGIN, begin=ColocatedBegin(
                self._sent.outgoing(manifest.info), tuple(sorted(skip)), self.config.rollback,
                keep_buffers)))
        except BaseException:
            self._sent.forget()
            if started:
                await _quietly(engine.finish_weight_update)
            await stack.aclose()
            raise
        self._stack, self._mode = stack, mode
        self._started = time.perf_counter()
        self._rank_failed = False

    def _check_can_begin(self, manifest: ColocatedManifest, mode: RefitMode) -> None:
        if self.config.refit_ranks != 1:
            raise InvalidValue("tensor_parallel_size x pipeline_parallel_size",
                               self.config.refit_ranks, COLOCATED_TP_RULE)
        if self.config.refit_protocol is not RefitProtocol.PACKED:
            raise InvalidValue("refit_protocol", self.config.refit_protocol.value,
                               f"vLLM's own transfer engine takes no colocated refit; workers"
                               f" with {RefitProtocol.PACKED.value!r} (the default) do")
        modes = self.runtime.require_features().refit_modes
        if mode not in modes:
            raise InvalidValue("mode", mode, f"this vLLM keeps labels exact only in"
                               f" {', '.join(modes)}")
        check_complete(manifest.info, self.runtime.metas, self.runtime.ignored)

    async def load_colocated_bucket(self, bucket: Bucket, handle: BufferHandle) -> None:
        await self._request(ColocatedUpdate(ColocatedStep.BUCKET,
                                            buckets=(ColocatedBucket.of(bucket, handle),)))

    async def load_colocated_buckets(self, buckets: Sequence[tuple[Bucket, BufferHandle]]) -> None:
        """All of them in one request: one crossing into vLLM's workers, not one per bucket."""
        await self._request(ColocatedUpdate(ColocatedStep.BUCKETS, buckets=tuple(
            ColocatedBucket.of(bucket, handle) for bucket, handle in buckets)))

    async def end_colocated(self, *, version: int | None) -> int:
        """Finish vLLM's update and commit (cache, version) still paused, then resume. A
        failure here reaches ``abandon_colocated`` with the stack still open."""
        stack = self._open_stack()
        engine = self.runtime.require_engine()
        await self._request(ColocatedUpdate(ColocatedStep.END))
        await engine.finish_weight_update()
        version = await self.runtime.standing.commit(engine, self._mode, version)
        self._stack = None
        try:
            ranks = await engine.collective_rpc(REFIT_STATS_RPC)
            self._stats = {**ColocatedStats.from_wire(ranks[0]).to_wire(),
                           "host_seconds": time.perf_counter() - self._started}
        finally:
            await stack.aclose()
        return version

    async def abandon_colocated(self, reason: str) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._sent.forget()  # a failed refit: the next begin carries the info
        engine = self.runtime.require_engine()
        if not self._rank_failed:  # else the rank recovered already and vLLM ended
            with contextlib.suppress(RefitError):  # the update when the step failed there
                await self._request(ColocatedUpdate(ColocatedStep.ABORT, reason=reason))
            await _quietly(engine.finish_weight_update)
        await self.runtime.standing.note_failed_refit(engine)
        await stack.aclose()  # resume generation, release the weight lock

    def colocated_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    async def release_colocated(self) -> None:
        engine = self.runtime.engine
        if engine is not None:  # a closed engine keeps nothing open
            await engine.collective_rpc(RELEASE_BUFFERS_RPC)

    async def _request(self, update: ColocatedUpdate) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:  # the step crosses into vLLM's worker processes
            await self.runtime.require_engine().update_weights(
                WeightTransferUpdateRequest(update_info=update.to_wire()))
        except Exception as error:
            self._rank_failed = True
            raise RefitError(f"colocated {update.step.value} failed inside vLLM:"
                             f" {first_line(error)}") from error

    def _open_stack(self) -> contextlib.AsyncExitStack:
        if self._stack is None:
            raise RefitError("no colocated refit begun on this engine")
        return self._stack


async def _quietly(step: Callable[[], Awaitable[Any]]) -> None:
    with contextlib.suppress(Exception):  # already finished: vLLM says so, nothing to undo
        await step()
