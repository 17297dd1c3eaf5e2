"""What crosses between the worker host (``adapters/vllm/host``) and the code vLLM runs in its
own worker processes (``adapters/vllm/inside``): the names each side registers or calls, and one
message class per crossing. The host builds a message from typed values and sends ``to_wire()``;
the inside parses it once with ``from_wire`` where it lands (and the host parses the inside's
answers the same way). Nothing here imports vLLM or torch.

| crossing                              | message                                              |
| host -> inside, joining the group     | ``PackedInitInfo`` (``init_weight_transfer_engine``) |
| host -> inside, one refit             | ``PackedUpdateInfo`` (``update_weights``)            |
| host -> inside, one colocated step    | ``ColocatedUpdate`` (``update_weights``)             |
| inside -> host, how a refit ended     | ``RefitStats`` and its kinds (``REFIT_STATS_RPC``)    |

The refit info (every tensor's name, shape and dtype: hundreds of entries for a real model)
travels once per change: a refit or colocated begin carries it only when it differs from the
last one this engine received that way, and the inside keeps what it received
(``RefitInfoOnce``, on both sides). A new join and a failed refit make both sides forget it,
so the next message carries it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from rollout_fleet.core.colocated_refit import BufferHandle, ColocatedStep
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.refit import Bucket, GroupJoin, RefitInfo, RefitRollback

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
DISK_RELOADED_RPC = "rollout_fleet_disk_reloaded"
# How long vLLM's queue readers busy-poll on a CPU: set by the host, read by the project's plugin.
BUSY_POLL_ENV = "ROLLOUT_FLEET_VLLM_BUSY_POLL_S"
# vLLM's own worker method: reload the weights in place from a folder (``weights_path``).
VLLM_RELOAD_RPC = "reload_weights"


def _fields(wire: Any, what: str, required: Sequence[str], optional: Sequence[str] = ()
            ) -> Mapping[str, Any]:
    """``wire`` as a mapping with every required key and no key but these (ValueError else)."""
    keys = set(wire) if isinstance(wire, Mapping) else None
    if keys is None or keys - {*required, *optional} or not keys >= set(required):
        rule = [f"needs {', '.join(map(repr, required))}" if required else "",
                f"may have {', '.join(map(repr, optional))}" if optional else ""]
        raise ValueError(f"invalid {what} for {BACKEND_NAME}: keys"
                         f" {sorted(keys) if keys is not None else type(wire).__name__};"
                         f" it {' and '.join(part for part in rule if part)}")
    return wire


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
        fields = _fields(wire, "init_info", ("join",), ("rollback",))
        return cls(GroupJoin.from_wire(fields["join"]),
                   RefitRollback.parse(fields.get("rollback", RefitRollback.NONE.value), "rollback"))


@dataclasses.dataclass(frozen=True)
class PackedUpdateInfo:
    """One refit: the tensors in wire order (None: the same as the last refit's, which the
    inside kept), and the names received but not loaded (a tied model's alias,
    ``lm_head.weight``, which vLLM's loader skips when it reads a checkpoint; loaded, it would
    overwrite the embedding it shares)."""

    info: RefitInfo | None
    skip: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"skip": list(self.skip)}
        if self.info is not None:
            wire["refit_info"] = self.info.to_wire()
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> PackedUpdateInfo:
        fields = _fields(wire, "update_info", (), ("refit_info", "skip"))
        return cls(_info(fields), _names(fields.get("skip", ())))


@dataclasses.dataclass(frozen=True)
class ColocatedBegin:
    """A colocated refit begins: its tensors (None: the last colocated refit's), those not to
    load, the rollback, and whether the sender keeps its buffers for the next refit."""

    info: RefitInfo | None
    skip: tuple[str, ...] = ()
    rollback: RefitRollback = RefitRollback.NONE
    keep_buffers: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"skip": list(self.skip), "rollback": self.rollback.value,
                                "keep_buffers": self.keep_buffers}
        if self.info is not None:
            wire["refit_info"] = self.info.to_wire()
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> ColocatedBegin:
        fields = _fields(wire, "colocated begin", (),
                         ("refit_info", "skip", "rollback", "keep_buffers"))
        keep = fields.get("keep_buffers", False)
        if not isinstance(keep, bool):
            raise ValueError(f"keep_buffers must be true or false, not {keep!r}")
        return cls(_info(fields), _names(fields.get("skip", ())),
                   RefitRollback.parse(fields.get("rollback", RefitRollback.NONE.value),
                                       "rollback"), keep)


@dataclasses.dataclass(frozen=True)
class ColocatedBucket:
    """One bucket in one of the trainer's buffers: each tensor's name and offset, its bytes."""

    tensors: tuple[tuple[str, int], ...]
    nbytes: int
    handle: BufferHandle

    @classmethod
    def of(cls, bucket: Bucket, handle: BufferHandle) -> ColocatedBucket:
        return cls(tuple((e.meta.name, e.offset) for e in bucket.entries), bucket.nbytes, handle)

    def to_wire(self) -> dict[str, Any]:
        return {"tensors": [list(pair) for pair in self.tensors], "nbytes": self.nbytes,
                "handle": self.handle.to_wire()}

    @classmethod
    def from_wire(cls, wire: Any) -> ColocatedBucket:
        fields = _fields(wire, "colocated bucket", ("tensors", "nbytes", "handle"))
        tensors, nbytes = fields["tensors"], fields["nbytes"]
        if not isinstance(tensors, Sequence) or not all(
                isinstance(pair, Sequence) and len(pair) == 2 and isinstance(pair[0], str)
                and _count(pair[1]) for pair in tensors):
            raise ValueError(f"a colocated bucket's tensors are [name, offset] pairs, not"
                             f" {tensors!r:.200}")
        if not _count(nbytes):
            raise ValueError(f"a colocated bucket's nbytes is an int >= 0, not {nbytes!r}")
        return cls(tuple((name, offset) for name, offset in tensors), nbytes,
                   BufferHandle.from_wire(fields["handle"]))


@dataclasses.dataclass(frozen=True)
class ColocatedUpdate:
    """One step of a colocated refit (``ColocatedStep``): ``{"colocated": {step: body}}``."""

    step: ColocatedStep
    begin: ColocatedBegin | None = None
    buckets: tuple[ColocatedBucket, ...] = ()  # one for BUCKET, any number for BUCKETS
    reason: str = ""  # ABORT's

    def to_wire(self) -> dict[str, Any]:
        body: Any = {}
        if self.step is ColocatedStep.BEGIN and self.begin is not None:
            body = self.begin.to_wire()
        elif self.step is ColocatedStep.BUCKET:
            body = self.buckets[0].to_wire()
        elif self.step is ColocatedStep.BUCKETS:
            body = [bucket.to_wire() for bucket in self.buckets]
        elif self.step is ColocatedStep.ABORT:
            body = self.reason
        return {COLOCATED_KEY: {self.step.value: body}}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> ColocatedUpdate:
        """Parsed once where it lands; a bad step is a RefitError naming what is wrong."""
        step = wire.get(COLOCATED_KEY)
        if not isinstance(step, Mapping) or len(step) != 1:
            raise RefitError(f"a colocated step is {{{COLOCATED_KEY!r}: {{step: body}}}}, not"
                             f" {step!r:.200}")
        (spelt, body), = step.items()
        kind = ColocatedStep.parse(spelt, "colocated step")
        try:
            if kind is ColocatedStep.BEGIN:
                return cls(kind, begin=ColocatedBegin.from_wire(body))
            if kind is ColocatedStep.BUCKET:
                return cls(kind, buckets=(ColocatedBucket.from_wire(body),))
            if kind is ColocatedStep.BUCKETS:
                if not isinstance(body, list):
                    raise ValueError(f"colocated buckets are a list, not {type(body).__name__}")
                return cls(kind, buckets=tuple(ColocatedBucket.from_wire(b) for b in body))
        except ValueError as error:  # InvalidValue is one
            raise RefitError(f"colocated {kind.value}: {error}") from error
        return cls(kind, reason=str(body) if kind is ColocatedStep.ABORT else "")


class RefitInfoOnce:
    """One side's memory of the refit info the other side holds (see the module's text)."""

    def __init__(self) -> None:
        self._last: RefitInfo | None = None

    def outgoing(self, info: RefitInfo) -> RefitInfo | None:
        """What a message carries: ``info`` if the other side does not hold it yet, else None."""
        if self._last is not None and self._last == info:
            return None
        self._last = info
        return info

    def incoming(self, sent: RefitInfo | None) -> RefitInfo:
        """The info a message means: the one it carries (kept from now on), else the kept one."""
        if sent is not None:
            self._last = sent
        elif self._last is None:
            raise RefitError("a refit came without its refit info and none is kept here (the"
                             " host sends it again after a new join or a failed refit)")
        return self._last

    def forget(self) -> None:
        self._last = None


S = TypeVar("S", bound="RefitStats")


@dataclasses.dataclass
class RefitStats:
    """How a rank's last refit ended, as the inside keeps it and the host reads it."""

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
    def from_wire(cls: type[S], wire: Mapping[str, Any]) -> S:
        """The fields of this kind of stats (a rank may report a kind with more)."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in wire.items() if k in known})

    @classmethod
    def unknown(cls) -> RefitStats:
        """A rank with no stats of the project's (vLLM's own engines keep none) is torn: a
        failed refit there leaves no copy to roll back to."""
        return cls(torn=True)


@dataclasses.dataclass
class ShardedRefitStats(RefitStats):
    """A sharded refit's: what this rank received (its planned bytes, the bytes that came in,
    how many of them were whole tensors for want of a slice mapping) and what the packed
    protocol would have delivered to it (every tensor in full)."""

    planned_bytes: int = 0
    received_bytes: int = 0
    fallback_bytes: int = 0  # whole tensors, cut by vLLM's loaders as from a checkpoint
    full_bytes: int = 0
    sliced_tensors: int = 0
    whole_tensors: int = 0


@dataclasses.dataclass
class ColocatedStats(RefitStats):
    """A colocated refit's: the buffers mapped at most at once, and the copies made of tensors
    the loader still held when their bucket was loaded (alive at most at once)."""

    buckets: int = 0
    mapped_peak_bytes: int = 0
    held_copy_bytes: int = 0
    held_copy_peak_bytes: int = 0
    opened_buffers: int = 0  # handles this refit opened (0 where every buffer was kept open)
    replayed: bool = False  # the loader's recorded copies made again (``load_replay``)
    replay_refusal: str = ""  # why the last recorded load cannot be replayed ("" if it can)


def _info(fields: Mapping[str, Any]) -> RefitInfo | None:
    wire = fields.get("refit_info")
    return None if wire is None else RefitInfo.from_wire(wire)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or \
            not all(isinstance(name, str) for name in value):
        raise ValueError(f"invalid update_info for {BACKEND_NAME}: skip must be a list of"
                         f" tensor names, not {value!r}")
    return tuple(value)
