"""Refit specs: what the trainer sends, how it is cut into packed buffers, who holds which rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.errors import InvalidValue, WorldSizeMismatch, shown
from rollout_fleet.core.validate import (
    Vocabulary,
    check_bool,
    check_int_at_least,
    finite_at_least,
    int_at_least,
    is_int,
    non_empty_str,
    one_of,
    positive_int,
)

# Bytes per element of each dtype a refit may carry (names as torch prints them, without "torch.").
DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class RefitProtocol(Vocabulary):
    """How a refit's bytes travel: a sender spec's ``protocol``, an engine's ``refit_protocol``."""

    PACKED = "rollout-fleet-packed-v1"  # one trainer rank sends packed buffers over the group
    VLLM = "vllm"  # vLLM's own NCCL weight-transfer engine (NeMo-RL's trainers speak it)
    SHARDED = "rollout-fleet-sharded-v1"  # every trainer rank sends, each engine rank its slices
    COLOCATED = "rollout-fleet-colocated-v1"  # read in place from a trainer's shared buffers


class RefitFanout(Vocabulary):
    """How the packed buffers reach every worker of a gloo group (a sender spec's ``fanout``).
    NCCL's broadcast already pipelines its chunks down a ring, so an NCCL group broadcasts
    whatever the spec says."""

    BROADCAST = "broadcast"  # the group's broadcast: the trainer sends every byte to each worker
    # the workers relay each piece down two binary trees (core/fanout.py): each receives
    # the bytes once and sends at most the refit's bytes and one piece, whatever the workers
    TREE = "tree"


# The protocols a refit group carries (an engine's refit_protocol names one of them); the
# colocated protocol has no group: it is chosen by the [colocation] section instead.
GROUP_PROTOCOLS = (RefitProtocol.PACKED, RefitProtocol.VLLM, RefitProtocol.SHARDED)


class RefitRollback(Vocabulary):
    """What an engine does after a refit that died half way (its ``refit_rollback``)."""

    NONE = "none"  # keep no copy: the weights are torn, rollouts refused until a refit succeeds
    LAST_GOOD = "last_good"  # restore the previous refit's weights from a copy kept for it


class RefitMode(Vocabulary):
    """What a refit does with the rollouts in flight (each engine maps them onto its own
    pauses). Parsed where it enters (``refit_mode``: a trainer's call, a worker's control
    body); typed from there on."""

    DRAIN = "drain"  # new rollouts wait, those in flight finish on the old weights, then the swap
    # rollouts in flight pause, the weights swap, they continue on the new weights with the KV
    # cache of their earlier tokens as it was (computed by the old ones)
    KEEP = "keep"
    RECOMPUTE = "recompute"  # as keep, but their KV cache is recomputed under the new weights


TRANSFER_BACKENDS = ("gloo", "nccl")
DEFAULT_REFIT_MODE = RefitMode.DRAIN
BUFFER_ALIGN = 256  # every tensor starts on a 256-byte boundary: any dtype view is legal, GPU copies coalesce


def refit_mode(value: Any, field: str = "mode") -> RefitMode:
    """A refit mode by name (``None``: the default); InvalidValue naming the field otherwise."""
    return DEFAULT_REFIT_MODE if value is None else RefitMode.parse(value, field)


def next_version(current: int, wanted: Any = None, field: str = "weight_version") -> int:
    """The weight version after a refit: ``wanted`` (the fleet's, for a worker that joined
    late), else ``current + 1``. Versions only go up: anything else is refused."""
    if wanted is None:
        return current + 1
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted <= current:
        raise InvalidValue(field, wanted, f"must be an int above this engine's version {current}")
    return wanted


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` / ``"torch.float32"`` / ``"float32"`` -> ``"float32"``; refuses unknown names."""
    try:
        name: str | None = str(dtype).removeprefix("torch.")
    except (ValueError, RecursionError):  # a huge int or deeply nested value is no dtype
        name = None
    if name is None or name not in DTYPE_BYTES:
        raise InvalidValue("dtype", dtype, f"must be one of {', '.join(sorted(DTYPE_BYTES))}")
    return name


def _shape(value: Any, field: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, Mapping)):  # iterable, but "" would read as a scalar's shape
        raise InvalidValue(field, value, "a shape is a sequence of ints")
    try:
        dims = tuple(value)
    except TypeError:
        raise InvalidValue(field, value, "a shape is a sequence of ints") from None
    for d in dims:
        if not is_int(d) or d < 0:
            raise InvalidValue(field, value, "every dimension is an int >= 0")
    return dims


@attrs.frozen(cache_hash=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidValue("tensor name", self.name, "must be a non-empty string")
        object.__setattr__(self, "shape", _shape(self.shape, f"shape of {self.name!r}"))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def numel(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@attrs.frozen(cache_hash=True)  # cached: a transfer looks up its plan by the info
class RefitInfo:
    """The ordered tensors of one refit. The order is the wire order on both sides."""

    tensors: tuple[TensorMeta, ...]
    packed: bool = True

    def __attrs_post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise InvalidValue("refit info", dupes, "tensor names must be unique")

    @classmethod
    def from_state_dict_info(cls, info: Mapping[str, Any], packed: bool = True) -> "RefitInfo":
        """NeMo-RL's ``{name: (shape, dtype)}``."""
        if not isinstance(info, Mapping):
            raise InvalidValue("state_dict_info", type(info).__name__, "must map name -> (shape, dtype)")
        metas = []
        for name, entry in info.items():
            try:
                shape, dtype = entry
            except (TypeError, ValueError):
                raise InvalidValue(f"state_dict_info[{shown(name)}]", entry, "must be (shape, dtype)") from None
            metas.append(TensorMeta(name, shape, dtype))
        return cls(tuple(metas), packed)

    def to_wire(self) -> dict[str, Any]:
        return {"packed": self.packed,
                "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors]}

    @classmethod
    def from_wire(cls, data: Any) -> "RefitInfo":
        if not isinstance(data, Mapping) or not isinstance(data.get("tensors"), list):
            raise InvalidValue("refit_info", data, "must be {'tensors': [[name, shape, dtype], ...]}")
        metas = []
        for index, entry in enumerate(data["tensors"]):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise InvalidValue(f"refit_info.tensors[{index}]", entry, "must be [name, shape, dtype]")
            metas.append(TensorMeta(*entry))
        return cls(tuple(metas), check_bool("refit_info.packed", data.get("packed", True)))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def check_against(self, expected: Mapping[str, TensorMeta]) -> None:
        """Refuse names, shapes or dtypes an engine does not have, before any byte moves."""
        for t in self.tensors:
            known = expected.get(t.name)
            if known is None:
                raise InvalidValue("tensor name", t.name, "the engine has no parameter of that name")
            if known.shape != t.shape:
                raise InvalidValue(f"shape of {t.name!r}", list(t.shape),
                                   f"the engine's parameter has shape {list(known.shape)}")
            if known.dtype != t.dtype:
                raise InvalidValue(f"dtype of {t.name!r}", t.dtype,
                                   f"the engine's parameter has dtype {known.dtype}")


def _sender_protocol(value: Any) -> RefitProtocol:
    return RefitProtocol.parse(value, "protocol")


def _sender_fanout(value: Any) -> RefitFanout:
    return RefitFanout.parse(value, "fanout")


@attrs.frozen
class CollectiveSenderSpec:
    """The packed-buffer geometry both ends of a refit must share."""

    protocol: RefitProtocol = attrs.field(default=RefitProtocol.PACKED,
                                          converter=_sender_protocol)
    buffer_bytes: int = attrs.field(default=1 << 30, validator=positive_int("buffer_bytes"))
    num_buffers: int = attrs.field(default=2, validator=positive_int("num_buffers"))
    fanout: RefitFanout = attrs.field(default=RefitFanout.BROADCAST, converter=_sender_fanout)

    def to_wire(self) -> dict[str, Any]:
        return {"protocol": self.protocol.value, "buffer_bytes": self.buffer_bytes,
                "num_buffers": self.num_buffers, "fanout": self.fanout.value}

    @classmethod
    def from_wire(cls, data: Any) -> "CollectiveSenderSpec":
        if not isinstance(data, Mapping):
            raise InvalidValue("sender_spec", data, "must be an object")
        unknown = set(data) - {"protocol", "buffer_bytes", "num_buffers", "fanout"}
        if unknown:
            raise InvalidValue("sender_spec", sorted(map(repr, unknown)), "unknown keys")
        return cls(**data)


@attrs.frozen
class BucketEntry:
    meta: TensorMeta
    offset: int  # byte offset inside the packed buffer


@attrs.frozen
class Bucket:
    entries: tuple[BucketEntry, ...]
    nbytes: int  # bytes to send: the end of the last tensor


def _align(offset: int) -> int:
    return (offset + BUFFER_ALIGN - 1) // BUFFER_ALIGN * BUFFER_ALIGN


def plan_buckets(tensors: Sequence[TensorMeta], buffer_bytes: int) -> tuple[Bucket, ...]:
    """Cut the ordered tensors into packed buffers.

    Tensors are appended in order; the tensor that reaches or crosses ``buffer_bytes`` closes
    its buffer (so a buffer holds at most ``buffer_bytes`` plus one tensor, and a tensor larger
    than a buffer travels alone). Empty tensors ride along at no cost.
    """
    check_int_at_least("buffer_bytes", buffer_bytes, 1)
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    end = 0
    for meta in tensors:
        offset = _align(end) if entries else 0
        entries.append(BucketEntry(meta, offset))
        end = offset + meta.nbytes
        if end >= buffer_bytes:
            buckets.append(Bucket(tuple(entries), end))
            entries, end = [], 0
    if entries:
        buckets.append(Bucket(tuple(entries), end))
    return tuple(buckets)


def max_bucket_bytes(buckets: Iterable[Bucket]) -> int:
    return max((b.nbytes for b in buckets), default=0)


@attrs.frozen
class RankLayout:
    """Trainer ranks first (0..T-1); worker i's ranks start at ``T + i * E`` (E = ranks per worker)."""

    train_world_size: int = attrs.field(validator=positive_int("train_world_size"))
    num_workers: int = attrs.field(validator=positive_int("num_workers"))
    ranks_per_worker: int = attrs.field(default=1, validator=positive_int("ranks_per_worker"))

    @property
    def world_size(self) -> int:
        return self.train_world_size + self.num_workers * self.ranks_per_worker

    def worker_rank(self, worker_index: int, local_rank: int = 0) -> int:
        if not is_int(worker_index) or not 0 <= worker_index < self.num_workers:
            raise InvalidValue("worker_index", worker_index, f"must be in [0, {self.num_workers})")
        if not is_int(local_rank) or not 0 <= local_rank < self.ranks_per_worker:
            raise InvalidValue("local_rank", local_rank, f"must be in [0, {self.ranks_per_worker})")
        return self.train_world_size + worker_index * self.ranks_per_worker + local_rank

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise WorldSizeMismatch(
                "world_size", world_size,
                f"must be train_world_size ({self.train_world_size}) + workers ({self.num_workers})"
                f" x ranks per worker ({self.ranks_per_worker}) = {self.world_size}",
            )



@attrs.frozen
class GroupJoin:
    """What one worker needs to join a refit group: where it is, how big, and its ranks.

    The worker's engine ranks (E = ``ranks_per_worker``: tensor x pipeline parallel) join at
    ``first_rank + j``, j = the engine rank; every one of them receives every bucket.
    """

    host: str = attrs.field(validator=non_empty_str("host"))
    port: int = attrs.field(validator=positive_int("port"))
    world_size: int = attrs.field(validator=int_at_least("world_size", 2))
    train_world_size: int = attrs.field(validator=positive_int("train_world_size"))
    first_rank: int = attrs.field(validator=positive_int("first_rank"))
    ranks_per_worker: int = attrs.field(validator=positive_int("ranks_per_worker"))
    sender_spec: CollectiveSenderSpec = attrs.field(factory=lambda: CollectiveSenderSpec())
    timeout_s: float = attrs.field(default=600.0, validator=finite_at_least("timeout_s", 0, strictly=True))
    # gloo or nccl; None: the worker's own (a driver does not know what its workers run on)
    backend: str | None = attrs.field(default=None, validator=one_of("backend", (*TRANSFER_BACKENDS, None)))

    def __attrs_post_init__(self) -> None:
        if self.first_rank < self.train_world_size:
            raise InvalidValue("first_rank", self.first_rank,
                               f"worker ranks start after the trainer's {self.train_world_size}")
        if self.first_rank + self.ranks_per_worker > self.world_size:
            raise InvalidValue("first_rank", self.first_rank,
                               f"+ ranks_per_worker ({self.ranks_per_worker}) exceeds world_size"
                               f" ({self.world_size})")

    def rank(self, engine_rank: int) -> int:
        """The group rank of engine rank ``engine_rank`` of this worker."""
        if not is_int(engine_rank) or not 0 <= engine_rank < self.ranks_per_worker:
            raise InvalidValue("engine_rank", engine_rank,
                               f"must be in [0, {self.ranks_per_worker})")
        return self.first_rank + engine_rank

    def to_wire(self) -> dict[str, Any]:
        wire = attrs.asdict(self, recurse=False)
        wire["sender_spec"] = self.sender_spec.to_wire()
        return wire

    @classmethod
    def from_wire(cls, data: Any, **defaults: Any) -> "GroupJoin":
        """A control body (or an init-info dict); ``defaults`` fill keys it does not carry."""
        if not isinstance(data, Mapping):
            raise InvalidValue("group join", data, "must be an object")
        fields = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise InvalidValue("group join", unknown, f"unknown keys; known: {sorted(fields)}")
        values = {**defaults, **data}
        missing = sorted(f for f in ("host", "port", "world_size", "train_world_size",
                                     "first_rank", "ranks_per_worker") if f not in values)
        if missing:
            raise InvalidValue("group join", missing, "missing keys")
        spec = values.get("sender_spec")
        if spec is not None and not isinstance(spec, CollectiveSenderSpec):
            values["sender_spec"] = CollectiveSenderSpec.from_wire(spec)
        return cls(**values)
