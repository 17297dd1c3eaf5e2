"""The optional ports an engine may implement besides the engine port (``core.engine``):
refit (``RefitTarget``; ``RefitByPart`` for an engine whose part answers it), reload from
disk (``DiskReloadTarget``), sleep (``Sleeper``) and colocated refit (``ColocatedTarget``).
Declared in core, where the worker's services drive them; ``rollout_fleet.ports.engine`` and
``rollout_fleet.ports.colocated`` export them with the other ports."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.core.checkpoint_check import CheckpointSummary
from rollout_fleet.core.colocated_refit import BufferHandle, ColocatedManifest
from rollout_fleet.core.refit import (
    DEFAULT_REFIT_MODE,
    Bucket,
    GroupJoin,
    RefitInfo,
    RefitMode,
    TensorMeta,
)
from rollout_fleet.core.sleep_state import DEFAULT_SLEEP_MODE, WAKE_TAGS, SleepState


class RefitTarget(ABC):
    """Optional port: an engine whose weights a trainer replaces, over the refit group, while
    it serves. The engine receives the transfer itself, where its weights live (for vLLM,
    inside its worker processes, one receiver per engine rank)."""

    @abstractmethod
    def weight_metas(self) -> Mapping[str, TensorMeta]:
        """Every parameter a refit may replace: name -> shape and dtype (checkpoint names)."""

    @abstractmethod
    def refit_ranks(self) -> int:
        """How many ranks of the refit group this engine holds (tensor x pipeline parallel)."""

    @abstractmethod
    async def init_collective(self, join: GroupJoin) -> None:
        """Every engine rank j joins the group at ``join.rank(j)``; returns once all joined.
        A wrong world size or a trainer that never comes is a ``RefitError`` within the
        join's timeout."""

    @abstractmethod
    async def update_weights(self, info: RefitInfo, *, mode: RefitMode = DEFAULT_REFIT_MODE,
                             version: int | None = None) -> int:
        """Receive every tensor of ``info`` from the trainer and load it, reset the prefix
        cache, and return the new weight version: ``version`` when given (a worker that joined
        late takes the fleet's version), else the previous one + 1. ``mode`` (``core.refit.RefitMode``) says
        what happens to rollouts in flight: drained first, kept (continuing on the new weights
        with their old KV), or kept with their KV recomputed under the new weights. A transfer that fails leaves the engine on
        consistent weights (its previous ones) or refusing rollouts until a refit succeeds,
        and raises ``RefitError``; a later refit works."""

    @abstractmethod
    def weight_version(self) -> int:
        """0 for the weights the engine started with; then what the last successful refit set."""

    @abstractmethod
    async def reset_cache(self) -> None:
        """Drop every cached prefix/KV block, so nothing computed under old weights is reused."""


class RefitByPart(RefitTarget):
    """The refit port of an engine composed of parts: every call goes to the engine's ``refit``
    part, which the worker's refit controls are handed themselves (``refit_target``)."""

    refit: RefitTarget

    def weight_metas(self) -> Mapping[str, TensorMeta]:
        return self.refit.weight_metas()

    def refit_ranks(self) -> int:
        return self.refit.refit_ranks()

    async def init_collective(self, join: GroupJoin) -> None:
        await self.refit.init_collective(join)

    async def update_weights(self, info: RefitInfo, *, mode: RefitMode = DEFAULT_REFIT_MODE,
                             version: int | None = None) -> int:
        return await self.refit.update_weights(info, mode=mode, version=version)

    def weight_version(self) -> int:
        return self.refit.weight_version()

    async def reset_cache(self) -> None:
        await self.refit.reset_cache()


def refit_target(engine: RefitTarget) -> RefitTarget:
    """What answers ``engine``'s refit port: its ``refit`` part where it is composed of parts
    (the worker's controls call it without a hop through the engine), else the engine."""
    return engine.refit if isinstance(engine, RefitByPart) else engine


class DiskReloadTarget(ABC):
    """Optional port: an engine that replaces its weights from a checkpoint folder (Hugging
    Face names, ``*.safetensors``) through its own loader, while it serves. Driven by
    ``core.disk_reload.WorkerDiskReload``; the folder must be readable where the engine runs."""

    @abstractmethod
    def weight_version(self) -> int:
        """The version the weights serve at (the refit port's, where the engine implements
        both): a reload sets a higher one."""

    @abstractmethod
    async def check_checkpoint(self, path: str) -> CheckpointSummary:
        """Refuse, naming the file or tensor (``IncompleteCheckpoint``, ``WeightMismatch``), a
        folder this engine could not load whole (``core.checkpoint_check``); nothing is paused,
        nothing changes."""

    @abstractmethod
    async def reload_from_disk(self, path: str, *, mode: RefitMode = RefitMode.KEEP,
                               version: int | None = None, deadline_s: float | None = None) -> int:
        """Check the folder as ``check_checkpoint`` does (refused before anything is paused),
        then pause as ``mode`` says (keep: rollouts in flight freeze and continue after on the
        new weights), load, drop the prefix cache (or set it apart from blocks kept rollouts
        hold), set the version (``version``, else the previous + 1), resume; return it. Past
        ``deadline_s`` before loading began: ``RefitError``, the previous weights serve. A load
        that fails or is abandoned half way leaves the weights as a failed refit does (the
        previous ones, or refused rollouts until a refit succeeds) and raises ``RefitError``."""


class Sleeper(ABC):
    """Optional port: an engine that gives its device memory back between generation phases
    (colocated RL: a trainer shares the device) and takes it back before the next one.
    ``core/sleep.py`` states the levels, the modes and the wake tags; ``SleeperContract``
    (``ports/contracts/sleeper.py``) checks an engine keeps them."""

    @abstractmethod
    async def sleep(self, level: int = 1, *, mode: str = DEFAULT_SLEEP_MODE) -> SleepState:
        """Level 1: free the KV cache, keep the weights; level 2: free the weights too (a
        refit must load weights before it serves again). ``mode`` says what happens to the
        rollouts in flight (wait, abort, keep). From then on every rollout is refused with
        ``EngineAsleep``. Asleep at ``level`` already: nothing changes. Asleep at another
        level: ``InvalidValue`` (wake it first)."""

    @abstractmethod
    async def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> SleepState:
        """Take back the memory of ``tags`` (``weights``, ``kv_cache``); it serves once both
        are back (and, after level 2, a refit has loaded weights). Awake: nothing changes."""

    @abstractmethod
    def sleep_state(self) -> SleepState:
        """What is freed now, the level it slept at, whether its weights were dropped."""

    def is_sleeping(self) -> bool:
        return self.sleep_state().sleeping


class ColocatedTarget(ABC):
    """Driven by ``core.colocated_service.WorkerColocatedRefit``: begin, one load per bucket in
    order, then end; abandon instead of end when the session failed."""

    @abstractmethod
    def weight_metas(self) -> Mapping[str, TensorMeta]:
        """Every parameter a colocated refit may carry (the refit port's, where the engine
        implements both): the manifest is checked against them before anything loads."""

    @abstractmethod
    def weight_version(self) -> int:
        """The version the weights serve at (the refit port's, where the engine implements
        both): a colocated refit must set a higher one."""

    @abstractmethod
    def colocated_transports(self) -> tuple[str, ...]:
        """The handle kinds this engine opens (``shm`` on the CPU, ``cuda`` on a GPU)."""

    @abstractmethod
    async def begin_colocated(self, manifest: ColocatedManifest, *, mode: RefitMode,
                              keep_buffers: bool = False) -> None:
        """Refuse what this engine cannot take, naming why (the names, shapes and dtypes were
        checked against ``weight_metas`` already), or get ready to load: pause rollouts as
        ``mode`` says. Nothing is loaded yet. ``keep_buffers``: the sender keeps its buffers
        for its next refits, so the engine may keep them open until ``release_colocated``."""

    @abstractmethod
    async def load_colocated_bucket(self, bucket: Bucket, handle: BufferHandle) -> None:
        """Open ``handle``, copy every tensor of ``bucket`` out of the buffer into the weights
        (or stage it), and hold no view into the buffer on return: the trainer reuses it.
        A handle that cannot be opened is a ``RefitError`` naming it."""

    async def load_colocated_buckets(self, buckets: Sequence[tuple[Bucket, BufferHandle]]) -> None:
        """Several buckets in order, as ``load_colocated_bucket`` loads each (a sender whose
        buffers are not reused within a refit sends them at once); an engine that crosses a
        process boundary per call may load them in one."""
        for bucket, handle in buckets:
            await self.load_colocated_bucket(bucket, handle)

    @abstractmethod
    async def end_colocated(self, *, version: int | None) -> int:
        """Every bucket is loaded: reset the prefix cache and set the weight version as every
        other refit does (``version``, else the previous + 1), resume, return the version."""

    @abstractmethod
    async def abandon_colocated(self, reason: str) -> None:
        """The session failed or was given up: leave the previous weights serving (or, where
        no copy was kept, refuse rollouts until a refit succeeds) and resume."""

    def colocated_stats(self) -> dict[str, Any]:
        """What the last colocated refit held and took (bytes, seconds); may be empty."""
        return {}

    async def release_colocated(self) -> None:
        """Close the trainer's buffers kept open across refits (its sender is done with them).
        An engine that opens each buffer only for its bucket keeps none: nothing to do."""
        return None


class ColocatedByPart(ColocatedTarget):
    """The colocated refit port of an engine composed of parts: each call goes to the engine's
    ``colocated`` part, but ``weight_metas``, which the engine's refit port answers."""

    colocated: ColocatedTarget

    def colocated_transports(self) -> tuple[str, ...]:
        return self.colocated.colocated_transports()

    async def begin_colocated(self, manifest: ColocatedManifest, *, mode: RefitMode,
                              keep_buffers: bool = False) -> None:
        await self.colocated.begin_colocated(manifest, mode=mode, keep_buffers=keep_buffers)

    async def load_colocated_bucket(self, bucket: Bucket, handle: BufferHandle) -> None:
        await self.colocated.load_colocated_bucket(bucket, handle)

    async def load_colocated_buckets(self, buckets: Sequence[tuple[Bucket, BufferHandle]]) -> None:
        await self.colocated.load_colocated_buckets(buckets)

    async def end_colocated(self, *, version: int | None) -> int:
        return await self.colocated.end_colocated(version=version)

    async def abandon_colocated(self, reason: str) -> None:
        await self.colocated.abandon_colocated(reason)

    def colocated_stats(self) -> dict[str, Any]:
        return self.colocated.colocated_stats()

    async def release_colocated(self) -> None:
        await self.colocated.release_colocated()
