"""Weight sender / receiver ports: moving a refit's tensors over a collective."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.sharded_refit import EngineLayout, ShardedPlan


class WeightSender(ABC):
    """Trainer side (rank 0 sends; other trainer ranks only join)."""

    spec: CollectiveSenderSpec

    @abstractmethod
    def send(self, info: RefitInfo, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Send every tensor of ``info``, in its order, packed per the bucket plan."""

    @abstractmethod
    def close(self) -> None: ...


class ReceivingEnd(ABC):
    """What every worker-side receiver has: its geometry, its buffers' account, ``close``."""

    spec: CollectiveSenderSpec
    # Set by a consumer that keeps the previous refit's tensors (a rollback copy) while the
    # next arrives: a receiver that reuses buffers keeps both sets warm. Ignored by default.
    hold_previous: bool = False

    @property
    def account(self) -> Any | None:
        """What counts the receive buffers' bytes (``live_bytes``, ``peak_bytes``,
        ``reset_peak()``); None (the default) for a receiver that does not count them."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class WeightReceiver(ReceivingEnd):
    """Worker side: one per worker rank."""

    @abstractmethod
    def receive(self, info: RefitInfo) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, tensor)`` in ``info`` order as packed buffers arrive."""


class SliceReceiver(ReceivingEnd):
    """Worker side of a sharded refit: one per engine rank, receiving only its slices."""

    engine_rank: int
    last_plan: ShardedPlan | None  # the plan of the last receive

    @abstractmethod
    def receive_declared(self, info: RefitInfo, engine: EngineLayout) -> Iterator[tuple[str, Any]]:
        """Declare this rank's engine layout, learn the trainer's, plan (``last_plan``), and
        yield ``(name, this rank's slice)`` in ``info`` order."""
