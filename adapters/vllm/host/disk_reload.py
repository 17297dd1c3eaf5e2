"""The vLLM engine's reload from a checkpoint folder (``VllmDiskReload``, the disk reload port of
``VllmEngine``), through vLLM's own in-place reload: every worker's ``reload_weights`` with the
folder, which vLLM's loader reads as it read the model at start.

The folder is checked first, from its safetensors headers (``core.checkpoint_check``): vLLM's
loader would load a truncated file up to where it breaks, and keep the old values of a
parameter the folder lacks; both leave old and new weights mixed. Then, under the weight lock:
paused as the refit mode says (keep: rollouts in flight freeze in vLLM's scheduler and continue
after), loaded, committed through the weights' standing (the version and its token labels; the
prefix cache reset, or set apart where kept rollouts hold blocks: vLLM's keep pause clears
nothing), resumed.

A reload that fails inside vLLM is rolled back where the previous weights came from a folder
(the model's, or the last reload's: ``_Source``) by reloading that folder; otherwise, or when
that fails too, the weights are torn and rollouts refused until a refit succeeds. Past its
deadline before loading began it is abandoned with nothing changed; past it while vLLM loads
(which cannot be interrupted) the weights are torn, as a collective refit abandoned there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import attrs
from rollout_fleet.adapters.shared.checkpoint_files import read_checkpoint
from rollout_fleet.adapters.shared.errors import first_line
from rollout_fleet.adapters.vllm.host.process import in_thread
from rollout_fleet.adapters.vllm.host.runtime import VllmRuntime
from rollout_fleet.adapters.vllm.messages import DISK_RELOADED_RPC, VLLM_RELOAD_RPC
from rollout_fleet.core.checkpoint_check import CheckpointSummary, check_checkpoint
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import RefitMode, next_version
from rollout_fleet.ports.engine import DiskReloadTarget

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeadlinePassed(RefitError):
    """The reload's deadline passed; says where it was."""


class _Deadline:
    """The time a reload has left (none: unbounded)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._ends = None if seconds is None else time.monotonic() + seconds

    async def within(self, step: Awaitable[T], doing: str) -> T:
        if self._ends is None:
            return await step
        try:
            return await asyncio.wait_for(step, max(0.0, self._ends - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            raise self.passed(doing) from None

    def check(self, doing: str) -> None:
        if self._ends is not None and time.monotonic() >= self._ends:
            raise self.passed(doing)

    def passed(self, doing: str) -> DeadlinePassed:
        return DeadlinePassed(f"reload_weights abandoned at this worker's deadline of"
                              f" {self.seconds:g} s, {doing}")


@attrs.frozen
class _Source:
    """The folder the serving weights were loaded from, at the version they serve at: a refit
    since (a higher version) means they came from elsewhere."""

    folder: str
    version: int


class VllmDiskReload(DiskReloadTarget):
    """The disk reload port of ``VllmEngine`` over the engine of ``runtime``."""

    def __init__(self, runtime: VllmRuntime) -> None:
        self.runtime = runtime
        self._source: _Source | None = None  # the folder to roll back to, where known

    def weight_version(self) -> int:
        return self.runtime.standing.version

    async def check_checkpoint(self, path: str) -> CheckpointSummary:
        self.runtime.require_engine()
        summary: CheckpointSummary = await in_thread(self._check, path)
        return summary

    def _check(self, path: str) -> CheckpointSummary:
        return check_checkpoint(read_checkpoint(path), self.runtime.metas, self.runtime.ignored)

    async def reload_from_disk(self, path: str, *, mode: RefitMode = RefitMode.KEEP,
                               version: int | None = None, deadline_s: float | None = None) -> int:
        deadline = _Deadline(deadline_s)
        engine = self.runtime.require_engine()
        if mode not in self.runtime.require_features().refit_modes:
            raise InvalidValue("mode", mode, "this vLLM labels no token with the weights it was"
                               " sampled under: only drain keeps labels exact")
        next_version(self.weight_version(), version)
        self.runtime.standing.check_refit_allowed()  # the weights' memory must be back
        folder = os.path.abspath(path)
        summary = await deadline.within(self.check_checkpoint(folder), "checking the folder")
        self._note_start_source(engine)
        lock = self.runtime.weight_lock
        await deadline.within(lock.acquire(), "waiting for the weight change before it")
        try:
            async with self.runtime.paused_for_refit(engine, mode):
                deadline.check("pausing the rollouts in flight")
                started = time.perf_counter()
                await self._load(engine, folder, deadline)
                loaded = time.perf_counter()
                version = await self.runtime.standing.commit(engine, mode, version)
                self._source = _Source(folder, version)
        finally:
            lock.release()
        log.info("weights v%d reloaded from %s: %d tensors, %.0f MiB in %.3f s (%s mode)",
                 version, folder, summary.tensors, summary.nbytes / 2**20, loaded - started,
                 mode.value)
        return version

    def _note_start_source(self, engine: Any) -> None:
        """Before any weight change, the weights are the model folder's."""
        folder = str(engine.model_config.model)
        if self._source is None and self.weight_version() == 0 and os.path.isdir(folder):
            self._source = _Source(os.path.abspath(folder), 0)

    async def _load(self, engine: Any, folder: str, deadline: _Deadline) -> None:
        standing = self.runtime.standing
        try:
            await deadline.within(engine.collective_rpc(
                VLLM_RELOAD_RPC, kwargs={"weights_path": folder}), "while vLLM loaded it")
        except (DeadlinePassed, asyncio.CancelledError) as stop:
            # vLLM's ranks go on loading: serve nothing until a refit succeeds rather than a
            # model half loaded.
            standing.health.mark_torn("a reload from disk was abandoned while vLLM loaded it")
            if isinstance(stop, DeadlinePassed):
                raise DeadlinePassed(f"{stop}; weights torn, rollouts refused until a refit"
                                     " succeeds") from None
            raise
        except Exception as error:
            outcome = await self._recover(engine)
            raise RefitError(f"vLLM's reload from {folder} failed: {first_line(error)}; "
                             + outcome) from error
        await engine.collective_rpc(DISK_RELOADED_RPC, kwargs={"failed": False})

    async def _recover(self, engine: Any) -> str:
        """After a failed reload: every layer back on its tensors, then the previous folder
        loaded again where the weights came from one; else torn. Says which."""
        source = self._source if (self._source is not None and self._source.version
                                  == self.weight_version()) else None
        try:
            await engine.collective_rpc(DISK_RELOADED_RPC, kwargs={"failed": True})
            if source is None:
                raise RefitError("the previous weights came from no folder")
            await engine.collective_rpc(VLLM_RELOAD_RPC, kwargs={"weights_path": source.folder})
            await engine.collective_rpc(DISK_RELOADED_RPC, kwargs={"failed": False})
        except Exception as error:
            reason = f"a reload from disk failed half way; no rollback ({first_line(error)})"
            self.runtime.standing.health.mark_torn(reason)
            return "weights torn, rollouts refused until a refit succeeds"
        return f"rolled back: the previous weights (from {source.folder}) serve"
