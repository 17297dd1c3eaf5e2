"""Optional port: an engine that takes colocated refits (``core.colocated_refit``).

The trainer shares buffers on the engine's own device; the engine reads each bucket straight
out of them. An engine implementing this is also a ``RefitTarget`` (parameters, weight
version, cache reset), and commits a colocated refit the way it commits any other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from rollout_fleet.core.colocated_refit import BufferHandle, ColocatedManifest
from rollout_fleet.core.refit import Bucket


class ColocatedTarget(ABC):
    """Driven by ``core.colocated_service.WorkerColocatedRefit``: begin, one load per bucket in
    order, then end; abandon instead of end when the session failed."""

    @abstractmethod
    def colocated_transports(self) -> tuple[str, ...]:
        """The handle kinds this engine opens (``shm`` on the CPU, ``cuda`` on a GPU)."""

    @abstractmethod
    async def begin_colocated(self, manifest: ColocatedManifest, *, mode: str) -> None:
        """Refuse what this engine cannot take, naming why (the names, shapes and dtypes were
        checked against ``weight_metas`` already), or get ready to load: pause rollouts as
        ``mode`` says. Nothing is loaded yet."""

    @abstractmethod
    async def load_colocated_bucket(self, bucket: Bucket, handle: BufferHandle) -> None:
        """Open ``handle``, copy every tensor of ``bucket`` out of the buffer into the weights
        (or stage it), and hold no view into the buffer on return: the trainer reuses it.
        A handle that cannot be opened is a ``RefitError`` naming it."""

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
