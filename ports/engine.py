"""The engine port (declared in core: ``rollout_fleet.core.engine``) and the optional refit
port an engine may also implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

from rollout_fleet.core.engine import (
    OPTIONAL_ROLLOUT_KEYWORDS,
    SAMPLING_OPTIONS,
    EngineFacts,
    EnginePort,
    KvEventSource,
    RolloutPiece,
    offered_keywords,
)
from rollout_fleet.core.refit import DEFAULT_REFIT_MODE, GroupJoin, RefitInfo, TensorMeta

__all__ = ["OPTIONAL_ROLLOUT_KEYWORDS", "SAMPLING_OPTIONS", "EngineFacts", "EnginePort",
           "KvEventSource", "RefitTarget", "RolloutPiece", "offered_keywords"]


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
    async def update_weights(self, info: RefitInfo, *, mode: str = DEFAULT_REFIT_MODE,
                             version: int | None = None) -> int:
        """Receive every tensor of ``info`` from the trainer and load it, reset the prefix
        cache, and return the new weight version: ``version`` when given (a worker that joined
        late takes the fleet's version), else the previous one + 1. ``mode`` (``core.refit.REFIT_MODES``) says
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
