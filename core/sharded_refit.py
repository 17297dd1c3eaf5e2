"""The plan of a many-source sharded refit: which trainer rank sends which bytes to which engine rank.

Every trainer rank holds dim-0 shards of the tensors (as FSDP and DTensor ``Shard(0)`` hold
them; uneven tails allowed) or a tensor whole (replicated: one owner sends it, owners chosen to
balance the senders' bytes). Every engine rank (``W`` workers x tensor-parallel ``E``; group
rank ``T + i*E + j``) needs only its tensor-parallel slice of each tensor, cut as vLLM's loaders
cut the checkpoint tensor (``tensor_slice``). Each piece is a range of rows of one sender's shard
(a row-parallel slice: those rows' columns of the slice) landing in one contiguous range of the
receiving rank's slice. Every rank computes the same plan from the same declarations; its
``digest`` goes into the header check, so ranks that disagree fail with one clear error.

The time floor of a refit over links of bandwidth B:
    time >= max(bytes into any one receiver, bytes out of any one sender) / B
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import DTYPE_BYTES, RefitInfo, TensorMeta, plan_buckets
from rollout_fleet.core.validate import check_int_at_least, is_int

__all__ = ["EngineLayout", "TrainerLayout", "plan_sharded_refit", "tensor_slice"]
VOCAB_PADDING = 64  # vLLM pads a vocabulary-parallel embedding's rows to a multiple of this
ALIGN = 256
Range = tuple[int, int]  # [start, stop) along one dimension
Slices = tuple[tuple["TensorSlice", ...], ...]  # per tensor-parallel rank, per tensor


def _names(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(names)


def chunk_rows(rows: int, ranks: int) -> tuple[int, ...]:
    """Rows per rank as ``torch.chunk`` (FSDP2, DTensor ``Shard(0)``) cuts them: ceil-sized
    chunks first, the tail shorter, trailing ranks possibly empty."""
    size = -(-rows // ranks) if rows else 0
    return tuple(max(0, min(size, rows - r * size)) for r in range(ranks))


@attrs.frozen
class TrainerLayout:
    """Per tensor (in refit order): rows held by each trainer rank, or None (replicated)."""

    train_world_size: int
    rows: tuple[tuple[int, ...] | None, ...]

    @classmethod
    def fsdp(cls, info: RefitInfo, train_world_size: int,
             replicated: Callable[[TensorMeta], bool] = lambda meta: False) -> "TrainerLayout":
        """Every tensor dim-0 sharded as ``torch.chunk`` does, except those ``replicated`` names
        (and scalars)."""
        return cls(train_world_size, tuple(
            None if not meta.shape or replicated(meta) else chunk_rows(meta.shape[0], train_world_size)
            for meta in info.tensors))

    def check(self, info: RefitInfo) -> None:
        check_int_at_least("train_world_size", self.train_world_size, 1)
        if len(self.rows) != len(info.tensors):
            raise InvalidValue("trainer layout", len(self.rows),
                               f"gives rows for that many tensors; the refit has {len(info.tensors)}")
        for meta, rows in zip(info.tensors, self.rows):
            if rows is None:
                continue
            if (len(rows) != self.train_world_size or not meta.shape
                    or any(not is_int(r) or r < 0 for r in rows) or sum(rows) != meta.shape[0]):
                raise InvalidValue(f"trainer layout of {meta.name!r}", list(rows),
                                   f"must be {self.train_world_size} row counts >= 0 summing to"
                                   f" dim 0 ({meta.shape[0] if meta.shape else 'a scalar has none'})")

    def to_wire(self) -> dict[str, Any]:
        return {"train_world_size": self.train_world_size,
                "rows": [None if r is None else list(r) for r in self.rows]}

    @classmethod
    def from_wire(cls, data: Any) -> "TrainerLayout":
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise InvalidValue("trainer layout", data, "must be {'train_world_size', 'rows'}")
        world = check_int_at_least("train_world_size", data.get("train_world_size"), 1)
        return cls(world, tuple(None if r is None else tuple(r) for r in data["rows"]))


@attrs.frozen
class EngineLayout:
    """W workers x tensor parallel E; heads as the model's config declares them. ``whole``:
    tensor names the engine loads whole (its loader for them takes no pre-cut slice): they are
    received in full, counted as fallback bytes."""

    num_workers: int
    tensor_parallel_size: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    whole: tuple[str, ...] = attrs.field(default=(), converter=_names)

    def check(self) -> None:
        for field in ("num_workers", "tensor_parallel_size"):
            check_int_at_least(field, getattr(self, field), 1)
        for field in ("num_heads", "num_kv_heads"):
            if getattr(self, field) is not None:
                check_int_at_least(field, getattr(self, field), 1, "must be None or an int >= 1")

    @property
    def engine_ranks(self) -> int:
        return self.num_workers * self.tensor_parallel_size

    def to_wire(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "whole": list(self.whole)}

    @classmethod
    def from_wire(cls, data: Any) -> "EngineLayout":
        fields = {f.name for f in attrs.fields(cls)}
        if not isinstance(data, dict) or not set(data) <= fields or not isinstance(
                data.get("whole", []), list):
            raise InvalidValue("engine layout", data, f"must be a dict of {', '.join(sorted(fields))}")
        return cls(**data)


@attrs.frozen
class TensorSlice:
    """An engine rank's part of a tensor: the ranges of ``dim`` (0 or 1), concatenated along it.
    ``kind`` says which rule cut it; ``"fallback"``: the mapping is unknown, the full tensor."""

    kind: str
    dim: int
    ranges: tuple[Range, ...]
    shape: tuple[int, ...]
    nbytes: int


def _split(size: int, parts: int, index: int) -> Range | None:
    if size % parts:
        return None
    per = size // parts
    return (index * per, (index + 1) * per)


def _kv_range(rows: int, heads: int, tp: int, rank: int, base: int) -> Range | None:
    """K or V rows for one rank: split by heads, or the rank's one head replicated (E > heads)."""
    if rows % heads or not (heads % tp == 0 or tp % heads == 0):
        return None
    head_dim = rows // heads
    per = max(1, heads // tp) * head_dim
    shard = rank if heads >= tp else rank // (tp // heads)
    return (base + shard * per, base + (shard + 1) * per)


def _column_ranges(module: str, meta: TensorMeta, layout: EngineLayout, rank: int
                   ) -> tuple[Range, ...] | None:
    """Dim-0 ranges of a column-parallel (or fused) tensor for one tensor-parallel rank."""
    rows, tp = meta.shape[0], layout.tensor_parallel_size
    heads, kv = layout.num_heads, layout.num_kv_heads
    if module == "qkv_proj":
        if heads is None or kv is None or rows % (heads + 2 * kv) or heads % tp:
            return None
        head_dim = rows // (heads + 2 * kv)
        q = _split(heads * head_dim, tp, rank)
        k = _kv_range(kv * head_dim, kv, tp, rank, heads * head_dim)
        v = _kv_range(kv * head_dim, kv, tp, rank, (heads + kv) * head_dim)
        return None if q is None or k is None or v is None else (q, k, v)
    if module in ("k_proj", "v_proj"):
        part = _kv_range(rows, kv, tp, rank, 0) if kv is not None else None
        return None if part is None else (part,)
    if module == "gate_up_proj":
        if rows % 2:
            return None
        half = rows // 2
        gate, up = _split(half, tp, rank), _split(half, tp, rank)
        return None if gate is None or up is None else (gate, (half + up[0], half + up[1]))
    part = _split(rows, tp, rank)  # q_proj, gate_proj, up_proj
    return None if part is None else (part,)


COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def _cut(meta: TensorMeta, kind: str, dim: int, ranges: Sequence[Range]) -> TensorSlice:
    length = sum(b - a for a, b in ranges)
    shape = tuple(length if d == dim else s for d, s in enumerate(meta.shape))
    return TensorSlice(kind, dim, tuple(ranges), shape, math.prod(shape) * DTYPE_BYTES[meta.dtype])


def tensor_slice(meta: TensorMeta, layout: EngineLayout, tp_rank: int) -> TensorSlice:
    """The slice of ``meta`` that tensor-parallel rank ``tp_rank`` loads, as vLLM's Llama-family
    loaders cut checkpoint tensors: column parallel (q/k/v, gate/up, fused qkv and gate_up) by
    output rows, row parallel (o, down) by input columns, vocabulary-parallel embeddings by
    padded row ranges, norms whole. Anything else: the full tensor, kind ``"fallback"``."""
    whole = [(0, meta.shape[0])] if meta.shape else [(0, 1)]
    if not meta.shape:
        return TensorSlice("whole" if layout.tensor_parallel_size == 1 else "fallback", 0, (),
                           (), meta.nbytes)
    if layout.tensor_parallel_size == 1:
        return _cut(meta, "whole", 0, whole)
    if meta.name in layout.whole:
        return _cut(meta, "fallback", 0, whole)
    parts = meta.name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if "norm" in module:
        return _cut(meta, "replicated", 0, whole)
    if module in COLUMN:
        ranges = _column_ranges(module, meta, layout, tp_rank)
        if ranges is not None:
            return _cut(meta, "column", 0, ranges)
    elif module in ROW:
        if parts[-1] == "bias":
            return _cut(meta, "replicated", 0, whole)
        part = _split(meta.shape[1], layout.tensor_parallel_size, tp_rank) if len(meta.shape) == 2 else None
        if part is not None:
            return _cut(meta, "row", 1, [part])
    elif module in VOCAB:
        padded = -(-meta.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        per = padded // layout.tensor_parallel_size if padded % layout.tensor_parallel_size == 0 else None
        if per is not None:
            start = min(tp_rank * per, meta.shape[0])
            return _cut(meta, "vocab", 0, [(start, min(start + per, meta.shape[0]))])
    return _cut(meta, "fallback", 0, whole)


@attrs.frozen
class Piece:
    """Rows [row_start, row_stop) of tensor ``tensor`` (its columns [col_start, col_stop) for a
    row-parallel slice; None: every column) from trainer rank ``sender`` to engine rank
    ``receiver`` (``i*E + j``), landing at ``offset`` bytes into the receiver's block."""

    bucket: int
    tensor: int
    sender: int
    receiver: int
    row_start: int
    row_stop: int
    col_start: int | None
    col_stop: int | None
    offset: int
    nbytes: int


@attrs.frozen
class ShardedPlan:
    info: RefitInfo
    trainer: TrainerLayout
    engine: EngineLayout
    buffer_bytes: int
    buckets: tuple[tuple[int, ...], ...]  # tensor indices per bucket, in order
    slices: Slices  # per tensor-parallel rank j, per tensor
    offsets: tuple[tuple[int, ...], ...]  # per engine rank, per tensor: offset in its bucket block
    block_bytes: tuple[int, ...]  # per engine rank: its largest bucket
    pieces: tuple[Piece, ...]  # the one issue order every rank follows
    owners: tuple[int | None, ...]  # per tensor: the trainer rank sending a replicated one
    sender_bytes: tuple[int, ...]
    receiver_bytes: tuple[int, ...]
    fallback_bytes: int  # bytes received whole because the tensor-parallel mapping is unknown
    digest: int

    def slice_of(self, receiver: int, tensor: int) -> TensorSlice:
        return self.slices[receiver % self.engine.tensor_parallel_size][tensor]


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def plan_digest(info: RefitInfo, trainer: TrainerLayout, engine: EngineLayout,
                buffer_bytes: int) -> int:
    text = json.dumps([info.to_wire(), trainer.to_wire(), engine.to_wire(), buffer_bytes],
                      sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def plan_sharded_refit(info: RefitInfo, trainer: TrainerLayout, engine: EngineLayout,
                       buffer_bytes: int) -> ShardedPlan:
    """The whole plan; pure, so every rank computes the same one from the same declarations."""
    trainer.check(info)
    engine.check()
    tp = engine.tensor_parallel_size
    slices = tuple(tuple(tensor_slice(m, engine, j) for m in info.tensors) for j in range(tp))
    buckets = _buckets(info, buffer_bytes)
    offsets, block_bytes = _block_layout(slices, buckets, engine, len(info.tensors))
    owners = _owners(info, trainer, slices, engine)
    pieces = tuple(_pieces(info, trainer, owners, slices, offsets, buckets, engine))
    sender_bytes, receiver_bytes = [0] * trainer.train_world_size, [0] * engine.engine_ranks
    for piece in pieces:
        sender_bytes[piece.sender] += piece.nbytes
        receiver_bytes[piece.receiver] += piece.nbytes
    fallback = sum(slices[g % tp][t].nbytes for g in range(engine.engine_ranks)
                   for t in range(len(info.tensors)) if slices[g % tp][t].kind == "fallback")
    return ShardedPlan(info, trainer, engine, buffer_bytes, buckets, slices, offsets,
                       tuple(block_bytes), pieces, owners, tuple(sender_bytes),
                       tuple(receiver_bytes), fallback,
                       plan_digest(info, trainer, engine, buffer_bytes))


def _buckets(info: RefitInfo, buffer_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Tensors grouped as the packed protocol groups them (by full bytes): the same cut for all."""
    index = {meta.name: i for i, meta in enumerate(info.tensors)}
    return tuple(tuple(index[e.meta.name] for e in bucket.entries)
                 for bucket in plan_buckets(info.tensors, buffer_bytes))


def _block_layout(slices: Slices, buckets: tuple[tuple[int, ...], ...], engine: EngineLayout,
                  count: int) -> tuple[tuple[tuple[int, ...], ...], list[int]]:
    offsets: list[tuple[int, ...]] = []
    block_bytes: list[int] = []
    for g in range(engine.engine_ranks):
        mine, largest = [0] * count, 0
        for bucket in buckets:
            end = 0
            for t in bucket:
                mine[t] = _align(end)
                end = mine[t] + slices[g % engine.tensor_parallel_size][t].nbytes
            largest = max(largest, end)
        offsets.append(tuple(mine))
        block_bytes.append(largest)
    return tuple(offsets), block_bytes


def _owners(info: RefitInfo, trainer: TrainerLayout, slices: Slices, engine: EngineLayout
            ) -> tuple[int | None, ...]:
    """A sender for each replicated tensor: the largest first, each to the least loaded rank
    (counting what the sharded tensors already make each rank send)."""
    load = [0] * trainer.train_world_size
    tp, workers = engine.tensor_parallel_size, engine.num_workers
    for t, (meta, rows) in enumerate(zip(info.tensors, trainer.rows)):
        if rows is None:
            continue
        for j in range(tp):
            for r, share in _shares(slices[j][t], meta, rows):
                load[r] += share * workers
    owners: list[int | None] = [None] * len(info.tensors)
    replicated = [t for t, rows in enumerate(trainer.rows) if rows is None]
    outgoing = {t: workers * sum(slices[j][t].nbytes for j in range(tp)) for t in replicated}
    for t in sorted(replicated, key=lambda t: (-outgoing[t], t)):
        owner = min(range(len(load)), key=lambda r: (load[r], r))
        owners[t] = owner
        load[owner] += outgoing[t]
    return tuple(owners)


def _row_bytes(meta: TensorMeta, cut: TensorSlice) -> int:
    """Bytes of one dim-0 row of the slice."""
    return math.prod(cut.shape[1:]) * DTYPE_BYTES[meta.dtype]


def _shares(cut: TensorSlice, meta: TensorMeta, rows: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(sender, bytes) of one slice from dim-0 shards held as ``rows``."""
    starts = [sum(rows[:r]) for r in range(len(rows))]
    for r, (start, count) in enumerate(zip(starts, rows)):
        for lo, hi in _row_spans(cut, meta):
            overlap = min(hi, start + count) - max(lo, start)
            if overlap > 0:
                yield r, overlap * _row_bytes(meta, cut)


def _row_spans(cut: TensorSlice, meta: TensorMeta) -> tuple[Range, ...]:
    """The dim-0 rows of the full tensor the slice takes, in the slice's order."""
    if cut.dim == 0:
        return cut.ranges
    return ((0, meta.shape[0]),)


def _pieces(info: RefitInfo, trainer: TrainerLayout, owners: tuple[int | None, ...],
            slices: Slices, offsets: tuple[tuple[int, ...], ...],
            buckets: tuple[tuple[int, ...], ...], engine: EngineLayout) -> Iterator[Piece]:
    tp = engine.tensor_parallel_size
    for b, bucket in enumerate(buckets):
        for t in bucket:
            meta, rows = info.tensors[t], trainer.rows[t]
            for g in range(engine.engine_ranks):
                yield from _tensor_pieces(b, t, g, meta, rows, owners[t], slices[g % tp][t],
                                          offsets[g][t])


def _tensor_pieces(bucket: int, t: int, g: int, meta: TensorMeta, rows: tuple[int, ...] | None,
                   owner: int | None, cut: TensorSlice, base: int) -> Iterator[Piece]:
    """Tensor ``t``'s pieces for engine rank ``g``: from its rows' holders, or its ``owner``."""
    replica_sender = owner if owner is not None else 0
    if not meta.shape:
        if cut.nbytes:
            yield Piece(bucket, t, replica_sender, g, 0, 1, None, None, base, cut.nbytes)
        return
    row_bytes = _row_bytes(meta, cut)
    cols: Range | tuple[None, None] = cut.ranges[0] if cut.dim == 1 else (None, None)
    holders = ([(replica_sender, 0, meta.shape[0])] if rows is None else
               [(r, sum(rows[:r]), sum(rows[:r]) + n) for r, n in enumerate(rows) if n])
    at = 0  # rows of the slice so far
    for lo, hi in _row_spans(cut, meta):
        for sender, start, stop in holders:
            a, z = max(lo, start), min(hi, stop)
            if z > a and row_bytes:
                yield Piece(bucket, t, sender, g, a, z, cols[0], cols[1],
                            base + (at + a - lo) * row_bytes, (z - a) * row_bytes)
        at += hi - lo
