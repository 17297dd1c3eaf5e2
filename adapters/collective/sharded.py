"""The many-source sharded refit over torch.distributed: every trainer rank sends its shards,
every engine rank receives only its tensor-parallel slices (the plan: core/sharded_refit.py).

Every rank of the group is a data rank (``init_group(..., every_rank=True)``); group rank
``T + i*E + j`` is engine rank ``i*E + j``. Before the first byte every rank contributes its
header row (protocol, geometry, the plan's digest, total bytes, role) to one all-reduce, so a
rank that declared another layout fails with the same error everywhere. Then every rank walks
the plan's pieces in one order and issues its own point-to-point sends or receives: the same
code over gloo and NCCL.

Memory: a sender has at most ``num_buffers`` buckets of sends in flight (a piece is a view of
its shard; a row-parallel piece, whose columns are strided, a contiguous copy of that piece); a
receiver holds ``num_buffers`` blocks of its largest bucket, reused as the packed receiver
reuses them (blocks.BlockPool, with the same byte account).
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from rollout_fleet.adapters.collective.group import CollectiveGroup
from rollout_fleet.adapters.collective.packing import BlockPool, ByteAccount, as_bytes, torch_dtype
from rollout_fleet.adapters.collective.wire import hash63, wait_all
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo, RefitProtocol
from rollout_fleet.core.sharded_refit import (
    EngineLayout,
    ShardedPlan,
    TrainerLayout,
    plan_sharded_refit,
)
from rollout_fleet.ports.collective import SliceReceiver

HEADER_FIELDS = ("protocol", "buffer_bytes", "num_buffers", "plan", "total_bytes",
                 "train_world_size", "role")
SENDER, RECEIVER, REFUSED = 1, 2, 3  # REFUSED: a trainer rank whose local shards were wrong


def _require_every_rank(group: CollectiveGroup) -> None:
    if not group.every_rank:
        raise InvalidValue("refit group", "trainer rank 0 and workers only",
                           "a sharded refit needs every rank in the data group (every_rank=True)")


def exchange_headers(group: CollectiveGroup, spec: CollectiveSenderSpec, plan: ShardedPlan,
                     refused: bool = False) -> None:
    """Every rank learns every header; any difference raises the same RefitError on all."""
    role = REFUSED if refused else SENDER if group.rank < group.train_world_size else RECEIVER
    row = [hash63(RefitProtocol.SHARDED.value), spec.buffer_bytes, spec.num_buffers, plan.digest,
           plan.info.total_bytes, plan.trainer.train_world_size, role]
    table = torch.zeros((group.world_size, len(HEADER_FIELDS)), dtype=torch.int64,
                        device=group.device)
    table[group.rank] = torch.tensor(row, dtype=torch.int64)
    group.wait(group.all_reduce_sum(table), "the header exchange")
    rows = table.cpu().tolist()
    problems = []
    leader = dict(zip(HEADER_FIELDS, rows[0]))
    for rank, values in enumerate(rows):
        mine = dict(zip(HEADER_FIELDS, values))
        wanted = SENDER if rank < group.train_world_size else RECEIVER
        if mine["role"] == REFUSED:
            problems.append(f"trainer rank {rank} refused its local shards (its error names them)")
        elif mine["role"] != wanted:
            problems.append(f"rank {rank} is not {'sending' if wanted == SENDER else 'receiving'}")
        for field in HEADER_FIELDS[:-1]:
            if mine[field] != leader[field]:
                problems.append(_differs(rank, field, mine[field], leader[field]))
    if plan.engine.engine_ranks + plan.trainer.train_world_size != group.world_size:
        problems.append(f"the plan has {plan.trainer.train_world_size} trainer ranks and"
                        f" {plan.engine.engine_ranks} engine ranks; the group has {group.world_size}")
    if problems:
        raise group.fail("the header check", "the ranks disagree on the sharded refit"
                         " (trainer layout, engine layout, tensors or geometry): "
                         + "; ".join(problems))


def exchange_layouts(group: CollectiveGroup, trainer: TrainerLayout | None,
                     engine: EngineLayout | None) -> tuple[TrainerLayout, EngineLayout]:
    """Trainer rank 0's trainer layout and engine rank 0's (group rank T) engine layout, learnt
    by every rank (two all-reduces of a few bytes): each side declares only what it knows.
    Every rank then plans with its own declaration and the other side's; the header check
    compares the digests, so a rank that declared something else fails everywhere at once."""
    t = group.train_world_size
    mine = trainer if group.rank == 0 else engine if group.rank == t else None
    text = json.dumps(mine.to_wire(), separators=(",", ":")).encode() if mine is not None else b""
    lengths = torch.zeros(2, dtype=torch.int64, device=group.device)
    slot = 0 if group.rank == 0 else 1
    if mine is not None:
        lengths[slot] = len(text)
    group.wait(group.all_reduce_sum(lengths), "the layout exchange")
    first, second = (int(n) for n in lengths.cpu().tolist())
    data = torch.zeros(first + second, dtype=torch.uint8, device=group.device)
    if mine is not None:
        start = 0 if slot == 0 else first
        data[start:start + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    group.wait(group.all_reduce_sum(data), "the layout exchange")
    raw = bytes(data.cpu().tolist())
    try:
        return (TrainerLayout.from_wire(json.loads(raw[:first])),
                EngineLayout.from_wire(json.loads(raw[first:])))
    except ValueError as error:
        raise group.fail("the layout exchange", f"a declared layout does not parse: {error}")


@functools.lru_cache(maxsize=8)
def declared_plan(info: RefitInfo, trainer: TrainerLayout, engine: EngineLayout,
                  buffer_bytes: int) -> ShardedPlan:
    """The plan, computed once per declaration (a trainer sends the same model every step)."""
    return plan_sharded_refit(info, trainer, engine, buffer_bytes)


def _differs(rank: int, field: str, theirs: int, leaders: int) -> str:
    if field in ("protocol", "plan"):
        return f"rank {rank} has a different {field} (hash {theirs:#x} vs rank 0's {leaders:#x})"
    return f"rank {rank} has {field}={theirs}, rank 0 has {field}={leaders}"


@functools.lru_cache(maxsize=8)
def _pieces_by_bucket(plan: ShardedPlan, side: str, rank: int) -> tuple[tuple[Any, ...], ...]:
    """This rank's pieces of each bucket, in the plan's order."""
    mine: list[list[Any]] = [[] for _ in plan.buckets]
    for piece in plan.pieces:
        if getattr(piece, side) == rank:
            mine[piece.bucket].append(piece)
    return tuple(tuple(p) for p in mine)


class ShardedWeightSender:
    """One trainer rank: sends the parts of its local shards the plan gives it."""

    def __init__(self, group: CollectiveGroup, spec: CollectiveSenderSpec | None = None) -> None:
        _require_every_rank(group)
        if group.rank >= group.train_world_size:
            raise InvalidValue("rank", group.rank, "a sender is a trainer rank")
        self.group = group
        self.spec = spec or CollectiveSenderSpec()

    def send(self, plan: ShardedPlan, local: Mapping[str, torch.Tensor]) -> None:
        """``local``: this rank's shard of each tensor (rows as the plan's trainer layout says;
        a replicated tensor whole)."""
        self.group.check_usable()
        try:
            self._check_local(plan, local)
        except InvalidValue:
            try:  # the other ranks learn why in the header check instead of a lost peer
                exchange_headers(self.group, self.spec, plan, refused=True)
            except RefitError:
                pass
            raise
        exchange_headers(self.group, self.spec, plan)
        in_flight: collections.deque = collections.deque()
        try:
            for bucket, pieces in enumerate(_pieces_by_bucket(plan, "sender", self.group.rank)):
                if len(in_flight) == self.spec.num_buffers:
                    wait_all(self.group, in_flight.popleft(), f"the sends before bucket {bucket + 1}")
                in_flight.append([self.group.send(self._source(plan, piece, local),
                                                  plan.trainer.train_world_size + piece.receiver)
                                  for piece in pieces])
            while in_flight:
                wait_all(self.group, in_flight.popleft(), "the last buckets")
        except Exception as exc:
            if not self.group.broken:
                self.group.fail("sending", exc)
            raise

    def _source(self, plan: ShardedPlan, piece: Any, local: Mapping[str, torch.Tensor]) -> torch.Tensor:
        meta, rows = plan.info.tensors[piece.tensor], plan.trainer.rows[piece.tensor]
        tensor = local[meta.name]
        if tensor.device != self.group.device:
            tensor = tensor.to(self.group.device)
        if not meta.shape:
            return as_bytes(tensor)
        start = 0 if rows is None else sum(rows[:self.group.rank])
        part = tensor[piece.row_start - start:piece.row_stop - start]
        if piece.col_start is not None:
            part = part[:, piece.col_start:piece.col_stop]
        return as_bytes(part)

    def _check_local(self, plan: ShardedPlan, local: Mapping[str, torch.Tensor]) -> None:
        rank = self.group.rank
        for meta, rows in zip(plan.info.tensors, plan.trainer.rows):
            tensor = local.get(meta.name)
            shape = meta.shape if rows is None else (rows[rank], *meta.shape[1:])
            if not isinstance(tensor, torch.Tensor):
                raise InvalidValue("tensor name", meta.name, f"trainer rank {rank} has no local"
                                   " shard of it")
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != torch_dtype(meta.dtype):
                raise InvalidValue(f"local shard of {meta.name!r} on trainer rank {rank}",
                                   [list(tensor.shape), str(tensor.dtype)],
                                   f"the layout says {list(shape)} {meta.dtype}")

    def close(self) -> None:
        self.group.close()


class ShardedWeightReceiver(SliceReceiver):
    """One engine rank: receives its slice of every tensor, yielded in refit order as views of
    its blocks (valid however long they are kept: a block still viewed is never reused)."""

    def __init__(self, group: CollectiveGroup, spec: CollectiveSenderSpec | None = None) -> None:
        _require_every_rank(group)
        if group.rank < group.train_world_size:
            raise InvalidValue("rank", group.rank, "a receiver is an engine rank, not a trainer rank")
        self.group = group
        self.spec = spec or CollectiveSenderSpec()
        self.engine_rank = group.rank - group.train_world_size
        self.last_plan: ShardedPlan | None = None
        self._blocks = BlockPool(group.device, capacity=self.spec.num_buffers)

    @property
    def account(self) -> ByteAccount:
        return self._blocks.account

    def receive_declared(self, info: RefitInfo, engine: EngineLayout
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """Declare this rank's engine layout, learn the trainer's, plan, receive (the plan
        stays in ``last_plan``)."""
        self.group.check_usable()
        trainer, _ = exchange_layouts(self.group, None, engine)
        self.last_plan = declared_plan(info, trainer, engine, self.spec.buffer_bytes)
        yield from self.receive(self.last_plan)

    def receive(self, plan: ShardedPlan) -> Iterator[tuple[str, torch.Tensor]]:
        self.group.check_usable()
        exchange_headers(self.group, self.spec, plan)
        yield from self.group.received_whole(self._receive_buckets(plan))

    def _receive_buckets(self, plan: ShardedPlan) -> Iterator[tuple[str, torch.Tensor]]:
        pieces = _pieces_by_bucket(plan, "receiver", self.engine_rank)
        depth, count = self.spec.num_buffers, len(plan.buckets)
        posted = collections.deque(self._post(plan, b, pieces[b]) for b in range(min(depth, count)))
        next_to_post = len(posted)
        for bucket in range(count):
            if not posted:  # one buffer: the next bucket is posted once this one is needed
                posted.append(self._post(plan, next_to_post, pieces[next_to_post]))
                next_to_post += 1
            block, works = posted.popleft()
            wait_all(self.group, works, f"bucket {bucket + 1}/{count}")
            for index, item in enumerate(self._views(plan, bucket, block)):
                yield item
                # The consumer took this bucket's first tensor: the previous block is free.
                if index == 0 and depth > 1 and bucket > 0 and next_to_post < count:
                    posted.append(self._post(plan, next_to_post, pieces[next_to_post]))
                    next_to_post += 1

    def _post(self, plan: ShardedPlan, bucket: int, pieces: tuple[Any, ...]):
        g = self.engine_rank
        nbytes = max((plan.offsets[g][t] + plan.slice_of(g, t).nbytes for t in plan.buckets[bucket]),
                     default=0)
        block = self._blocks.take(nbytes, plan.block_bytes[g])
        return block, [self.group.recv(block[p.offset:p.offset + p.nbytes], p.sender)
                       for p in pieces]

    def _views(self, plan: ShardedPlan, bucket: int, block: torch.Tensor):
        g = self.engine_rank
        for t in plan.buckets[bucket]:
            meta, cut = plan.info.tensors[t], plan.slice_of(g, t)
            offset = plan.offsets[g][t]
            raw = block[offset:offset + cut.nbytes]
            yield meta.name, raw.view(torch_dtype(meta.dtype)).reshape(cut.shape)

    def close(self) -> None:
        self._blocks.drop_kept()
        self.group.close()
