"""What crosses between the worker host (``adapters/vllm/host``) and the code vLLM runs in its
own worker processes (``adapters/vllm/inside``): the names each side registers or calls, and one
message class per crossing. The host builds a message from typed values and sends ``to_wire()``;
the inside parses it once with ``from_wire`` where it lands. Nothing here imports vLLM or torch.

| crossing                              | message                                              |
| host -> inside, joining the group     | ``PackedInitInfo`` (``init_weight_transfer_engine``) |
| host -> inside, one refit             | ``PackedUpdateInfo`` (``update_weights``)            |
| host -> inside, one colocated step    | ``colocated_update`` (``update_weights``)            |
| inside -> host, how a refit ended     | ``RefitStats`` (``REFIT_STATS_RPC``)                  |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.core.refit import GroupJoin, RefitInfo, RefitRollback

# vLLM's weight-transfer factory keys (``WeightTransferConfig.backend``).
BACKEND_NAME = "rollout_fleet_packed"
SHARDED_BACKEND_NAME = "rollout_fleet_sharded"
# ``update_weights``' key that marks a colocated step (the rest is the packed protocol's).
COLOCATED_KEY = "colocated"
# The class vLLM injects into every worker (``worker_extension_cls``), and its methods.
WORKER_EXTENSION = "rollout_fleet.adapters.vllm.inside.worker_extension.RolloutFleetWorkerExtension"
REFIT_STATS_RPC = "rollout_fleet_refit_stats"
RELEASE_BUFFERS_RPC = "rollout_fleet_release_buffers"
PRECISION_RPC = "rollout_fleet_precision"


@dataclasses.dataclass(frozen=True)
class PackedInitInfo:
    """Joining the refit group: where and as whom, and what to keep against a failed refit."""

    group_join: GroupJoin
    rollback: RefitRollback = RefitRollback.NONE

    def to_wire(self) -> dict[str, Any]:
        return {"join": self.group_join.to_wire(), "rollback": self.rollback.value}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> PackedInitInfo:
        """Parsed once, where it lands; a bad message is refused (ValueError) before joining."""
        extra = set(wire) - {"join", "rollback"}
        if extra or "join" not in wire:
            raise ValueError(f"invalid init_info for {BACKEND_NAME}: keys {sorted(wire)}, expected"
                             " 'join' and optionally 'rollback'")
        return cls(GroupJoin.from_wire(wire["join"]),
                   RefitRollback.parse(wire.get("rollback", RefitRollback.NONE.value), "rollback"))


@dataclasses.dataclass(frozen=True)
class PackedUpdateInfo:
    """One refit: the tensors in wire order, and the names received but not loaded (a tied
    model's alias, ``lm_head.weight``, which vLLM's loader skips when it reads a checkpoint;
    loaded, it would overwrite the embedding it shares)."""

    info: RefitInfo
    skip: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"refit_info": self.info.to_wire(), "skip": list(self.skip)}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> PackedUpdateInfo:
        extra = set(wire) - {"refit_info", "skip"}
        if extra or "refit_info" not in wire:
            raise ValueError(f"invalid update_info for {BACKEND_NAME}: keys {sorted(wire)},"
                             " expected 'refit_info' and optionally 'skip'")
        return cls(RefitInfo.from_wire(wire["refit_info"]), _names(wire.get("skip", ())))


def colocated_update(step: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """``update_weights``' message for one colocated step (``ColocatedStep.value``)."""
    return {COLOCATED_KEY: {step: dict(body)}}


@dataclasses.dataclass
class RefitStats:
    """How a rank's last refit ended, as the inside keeps it and the host reads it (the sharded
    and colocated engines add fields of their own)."""

    tensors: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    waiting_s: float = 0.0  # of which waiting for the next tensor to arrive (the wire)
    rolled_back: bool = False
    torn: bool = False
    # On CUDA: torch's allocated bytes on this rank's GPU before the receive, at its peak
    # during it, and after (what a refit costs in GPU memory); -1 elsewhere.
    cuda_before: int = -1
    cuda_peak: int = -1
    cuda_after: int = -1

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> RefitStats:
        """A rank with no stats of the project's (vLLM's own engines keep none) is torn: a
        failed refit there leaves no copy to roll back to."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in wire.items() if k in known})

    @classmethod
    def unknown(cls) -> RefitStats:
        return cls(torn=True)


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or \
            not all(isinstance(name, str) for name in value):
        raise ValueError(f"invalid update_info for {BACKEND_NAME}: skip must be a list of"
                         f" tensor names, not {value!r}")
    return tuple(value)
