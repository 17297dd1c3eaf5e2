"""How the pieces of a refit move over a refit group: each bucket cut into pieces, and every
piece broadcast by the trainer or relayed by the workers.

Over gloo a bucket goes as several pieces of at most ``GLOO_WIRE_CHUNK_BYTES`` each, all in
flight together: gloo sends one large broadcast to each receiver in turn, and smaller ones in
flight overlap (bench/bench_refit_collective.py: chunked broadcasts of the same bytes ran 1.2-2.7x
faster than one flat broadcast on the CPU). NCCL pipelines a large broadcast itself, so there a
bucket is one broadcast. Both sides derive the pieces from the backend and check the chunk in
the header.

With the ``tree`` fan-out (gloo) the pieces are not broadcast: the trainer sends each piece to
the head of one of two binary trees and every worker sends the pieces it receives on to its
children (core/fanout.py), so the trainer sends the refit's bytes once, not once per
worker, and no worker sends more than that and one piece: the same bytes, bit for bit, in
every block.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from typing import Any

import attrs
import torch
from rollout_fleet.adapters.collective.packing import BlockPool
from rollout_fleet.adapters.collective.group import CollectiveGroup
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import (
    Bucket,
    CollectiveSenderSpec,
    RefitFanout,
    RefitInfo,
    max_bucket_bytes,
    plan_buckets,
)
from rollout_fleet.core.fanout import TRAINER, PieceRoutes, RelayTrees

GLOO_WIRE_CHUNK_BYTES = 4 << 20
GLOO_DIRECT_MIN_BYTES = 1 << 20  # a tensor this large is sent from its own memory over gloo


def hash63(text: str) -> int:
    """A 63-bit digest of ``text``: fits a header's int64 on every rank."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


@functools.lru_cache(maxsize=8)
def bucket_plan(info: RefitInfo, buffer_bytes: int) -> tuple[Bucket, ...]:
    """The plan of a refit, computed once per info and geometry: a trainer sends the same
    model every step, and planning hundreds of tensors in Python costs about a millisecond
    before the first byte moves (a GPU refit of a 1B model takes 7 ms)."""
    return plan_buckets(info.tensors, buffer_bytes)


def wire_chunk_bytes(group: CollectiveGroup) -> int:
    """Bytes per broadcast on the wire at most; 0 = a bucket in one broadcast."""
    return GLOO_WIRE_CHUNK_BYTES if group.backend == "gloo" else 0


def relay_trees(group: CollectiveGroup, spec: CollectiveSenderSpec) -> RelayTrees | None:
    """The trees the pieces are relayed down (the ``tree`` fan-out over gloo), else None: the
    group broadcasts them (NCCL's broadcast pipelines down a ring of its own)."""
    if spec.fanout is RefitFanout.TREE and group.backend == "gloo":
        return RelayTrees(group.data_size - 1)
    return None


def fanout_in_use(group: CollectiveGroup, spec: CollectiveSenderSpec) -> RefitFanout:
    return RefitFanout.BROADCAST if relay_trees(group, spec) is None else RefitFanout.TREE


@attrs.frozen
class Piece:
    """One broadcast of a bucket: bytes [start, stop) of the bucket's block. ``direct`` is the
    entry whose own memory the sender sends them from; ``pack`` lists the entries the sender
    packs into its slot before this piece (the first piece of a packed run)."""

    start: int
    stop: int
    direct: int | None = None
    pack: tuple[int, ...] = ()


@functools.lru_cache(maxsize=4096)
def wire_pieces(bucket: Bucket, backend: str) -> tuple[Piece, ...]:
    """How a bucket goes on the wire; sender and receivers derive the same byte ranges.

    NCCL: one broadcast per bucket (it pipelines a large broadcast itself; 128 MiB pieces were
    slower on two H200s), packed unless one tensor fills the bucket alone. gloo: a tensor of at
    least ``GLOO_DIRECT_MIN_BYTES`` goes from its own memory, runs of smaller ones are packed
    together, and every range is cut into broadcasts of at most ``GLOO_WIRE_CHUNK_BYTES``, all
    in flight (gloo sends one large broadcast to one receiver at a time). On 2 shared cores the
    packing copy competes with the transfer: packing everything reached 0.57 of a chunked flat
    broadcast of the same bytes."""
    entries = [(i, e) for i, e in enumerate(bucket.entries) if e.meta.nbytes]
    if backend != "gloo":
        if len(entries) == 1 and entries[0][1].offset == 0:
            return (Piece(0, bucket.nbytes, direct=entries[0][0]),)
        return (Piece(0, bucket.nbytes, pack=tuple(i for i, _ in entries)),)
    ranges: list[tuple[int, int, int | None, tuple[int, ...]]] = []
    run: list[tuple[int, Any]] = []
    for index, entry in entries:
        if entry.meta.nbytes < GLOO_DIRECT_MIN_BYTES:
            run.append((index, entry))
            continue
        _close_run(ranges, run)
        ranges.append((entry.offset, entry.offset + entry.meta.nbytes, index, ()))
    _close_run(ranges, run)
    pieces = []
    for start, stop, direct, pack in ranges:
        for first in range(start, stop, GLOO_WIRE_CHUNK_BYTES):
            pieces.append(Piece(first, min(first + GLOO_WIRE_CHUNK_BYTES, stop), direct,
                                pack if first == start else ()))
    return tuple(pieces)


def _close_run(ranges: list[tuple[int, int, int | None, tuple[int, ...]]],
               run: list[tuple[int, Any]]) -> None:
    """A run of small entries, packed together: one byte range; the run is emptied."""
    if run:
        ranges.append((run[0][1].offset, run[-1][1].offset + run[-1][1].meta.nbytes, None,
                       tuple(i for i, _ in run)))
        run.clear()


def wait_all(group: CollectiveGroup, works: list[Any], what: str) -> None:
    for work in works:
        group.wait(work, what)


def rows_of_every_rank(group: CollectiveGroup, row: list[int], what: str) -> list[list[int]]:
    """Every data rank's ``row`` of int64s (one length everywhere), in data-rank order, on
    every data rank. gloo: gathered up the relay's first tree (each rank adds its children's
    tables to its own: the rows are apart) and the whole table sent back down it, so no rank
    handles more than three messages a way whatever the group's size, in 2 x depth hops (the
    ring of gloo's all-reduce took 2(N-1) steps, each waking the next process: 68 ms for 17
    ranks on 2 cores). NCCL: one all-reduce."""
    table = torch.zeros((group.data_size, len(row)), dtype=torch.int64, device=group.device)
    table[group.data_rank] = torch.tensor(row, dtype=torch.int64)
    if group.backend != "gloo":
        group.wait(group.all_reduce_sum(table), what)
        return table.cpu().tolist()
    me, trees = group.data_rank or TRAINER, RelayTrees(group.data_size - 1)
    children = trees.children(0, me)
    theirs = [torch.zeros_like(table) for _ in children]
    wait_all(group, [group.recv(t, child) for t, child in zip(theirs, children)], what)
    for part in theirs:
        table += part
    if me != TRAINER:
        group.wait(group.send(table, trees.parent(0, me)), what)
        group.wait(group.recv(table, trees.parent(0, me)), what)
    wait_all(group, [group.send(table, child) for child in children], what)
    return table.tolist()


class Emitter:
    """The trainer's sends of one refit, piece after piece: broadcast to the group, or (relayed)
    sent to the head of the piece's tree."""

    def __init__(self, group: CollectiveGroup, relay: RelayTrees | None) -> None:
        self._group = group
        self._relay = relay
        self._routes = PieceRoutes()

    def __call__(self, source: torch.Tensor) -> Any:
        if self._relay is None:
            return self._group.broadcast(source)
        (head,) = self._relay.children(self._routes.next_tree(source.numel()), TRAINER)
        return self._group.send(source, head)


class Inflow:
    """A worker's arriving buckets of one refit, each into a block of the pool: posted as
    broadcasts, or (relayed) as receives from each piece's parent, every piece sent on to its
    children as soon as it landed. A block is posted into again only once the sends out of it
    are done."""

    def __init__(self, group: CollectiveGroup, relay: RelayTrees | None, blocks: BlockPool,
                 plan: tuple[Bucket, ...]) -> None:
        if not group.data_rank:
            raise InvalidValue("rank", group.rank, "a receiver is a worker rank, not a trainer rank")
        self._me: int = group.data_rank
        self._group = group
        self._relay = relay
        self._blocks = blocks
        self._moving = [bucket for bucket in plan if bucket.nbytes]
        self._block_bytes = max_bucket_bytes(plan)
        self._count = len(plan)
        self._posted = 0  # buckets posted so far (of those that move)
        self._routes = PieceRoutes()
        self._sends: collections.deque = collections.deque()  # (bucket index, works), oldest first

    @property
    def more_to_post(self) -> bool:
        return self._posted < len(self._moving)

    def post_next(self, index: int) -> tuple[torch.Tensor, list[int], list[Any]]:
        """Post the next bucket's receives, while the consumer is at bucket ``index`` (every
        block it may reuse has no send out of it left); (its block, each piece's tree, works)."""
        self._sends_done_before(index)
        bucket = self._moving[self._posted]
        self._posted += 1
        block = self._blocks.take(bucket.nbytes, self._block_bytes)
        pieces = wire_pieces(bucket, self._group.backend)
        if self._relay is None:
            return block, [], [self._group.broadcast(block[p.start:p.stop]) for p in pieces]
        me, relay = self._me, self._relay
        trees = [self._routes.next_tree(p.stop - p.start) for p in pieces]
        return block, trees, [self._group.recv(block[p.start:p.stop], relay.parent(tree, me))
                              for p, tree in zip(pieces, trees)]

    def arrive(self, index: int, bucket: Bucket, posted: tuple[torch.Tensor, list[int], list[Any]]
               ) -> torch.Tensor:
        """Wait for bucket ``index`` (relayed: each piece sent on as it lands); its block."""
        block, trees, works = posted
        what = f"bucket {index + 1}/{self._count}"
        if self._relay is None:
            wait_all(self._group, works, what)
            return block
        me, relay, sends = self._me, self._relay, []
        pieces = wire_pieces(bucket, self._group.backend)
        for piece, tree, work in zip(pieces, trees, works):
            self._group.wait(work, what)
            for child in relay.children(tree, me):
                sends.append(self._group.send(block[piece.start:piece.stop], child))
        self._sends.append((index, sends))
        return block

    def finish(self) -> None:
        """Every send out of this refit's blocks is done."""
        self._sends_done_before(self._count)

    def _sends_done_before(self, index: int) -> None:
        while self._sends and self._sends[0][0] < index:
            bucket, works = self._sends.popleft()
            wait_all(self._group, works, f"sending bucket {bucket + 1}/{self._count} on")
