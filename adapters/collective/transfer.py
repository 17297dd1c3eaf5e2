"""Weight sender and receiver over a refit group: a header check, then packed buffers.

Before the first byte, every data rank shares its header row (protocol, buffer bytes, buffers
in flight, a hash of the refit info, total bytes, fan-out, role) with every other
(``wire.rows_of_every_rank``), so a mismatch is the same clear error everywhere.

Then the sender packs bucket k+1 while bucket k's pieces are in flight: ``num_buffers``
buffers rotate, and a buffer is refilled only after its previous pieces were sent. How each
piece travels (broadcast, or relayed down two trees by the workers) is wire.py's.
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, Self, TypeVar

import attrs
import torch
from rollout_fleet.adapters.collective.group import CollectiveGroup, init_group
from rollout_fleet.adapters.collective.packing import (
    BlockPool,
    ByteAccount,
    as_bytes,
    check_tensor,
    fresh_block,
    pack_bucket,
    torch_dtype,
    unpack_bucket,
)
from rollout_fleet.adapters.collective.sharded import ShardedWeightSender
from rollout_fleet.adapters.collective.wire import (
    Emitter,
    Inflow,
    Piece,
    bucket_plan,
    fanout_in_use,
    hash63,
    relay_trees,
    rows_of_every_rank,
    wait_all,
    wire_chunk_bytes,
    wire_pieces,
)
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import (
    Bucket,
    CollectiveSenderSpec,
    GroupJoin,
    RefitFanout,
    RefitInfo,
    dtype_name,
    max_bucket_bytes,
)
from rollout_fleet.ports.collective import WeightReceiver, WeightSender

HEADER_FORMAT = 3  # 3: the fan-out; 2: large tensors travel from their own memory over gloo
HEADER_FIELDS = ("header_format", "protocol", "buffer_bytes", "num_buffers", "refit_info",
                 "total_bytes", "wire_chunk_bytes", "fanout", "role")
SENDER, RECEIVER = 1, 2


@functools.lru_cache(maxsize=8)
def info_digest(info: RefitInfo) -> int:
    return hash63(json.dumps(info.to_wire(), sort_keys=True, separators=(",", ":")))


def header_row(spec: CollectiveSenderSpec, info: RefitInfo, role: int, chunk_bytes: int = 0,
               fanout: RefitFanout = RefitFanout.BROADCAST) -> list[int]:
    return [HEADER_FORMAT, hash63(spec.protocol.value), spec.buffer_bytes, spec.num_buffers,
            info_digest(info), info.total_bytes, chunk_bytes, hash63(fanout.value), role]


def exchange_headers(group: CollectiveGroup, spec: CollectiveSenderSpec, info: RefitInfo,
                     role: int) -> None:
    """Every data rank learns every header; any difference raises the same RefitError on all."""
    row = header_row(spec, info, role, wire_chunk_bytes(group), fanout_in_use(group, spec))
    rows = rows_of_every_rank(group, row, "the header exchange")
    problems = _header_problems(rows, group.train_world_size)
    if problems:
        raise group.fail("the header check", "sender and receivers disagree on the refit: "
                         + "; ".join(problems))


def _group_rank(data_rank: int, train_world_size: int) -> int:
    return 0 if data_rank == 0 else data_rank - 1 + train_world_size


def _header_problems(rows: list[list[int]], train_world_size: int) -> list[str]:
    sender = dict(zip(HEADER_FIELDS, rows[0]))
    problems = []
    if sender["role"] != SENDER:
        problems.append("rank 0 is not sending")
    for data_rank, row in enumerate(rows[1:], start=1):
        mine = dict(zip(HEADER_FIELDS, row))
        who = f"rank {_group_rank(data_rank, train_world_size)}"
        if mine["role"] != RECEIVER:
            problems.append(f"{who} is not receiving")
            continue
        for field in HEADER_FIELDS[:-1]:
            if mine[field] != sender[field]:
                problems.append(_describe(who, field, mine[field], sender[field]))
    return problems


def _describe(who: str, field: str, theirs: int, senders: int) -> str:
    if field in ("protocol", "refit_info", "fanout"):
        return f"{who} has a different {field} (hash {theirs:#x} vs the sender's {senders:#x})"
    return f"{who} has {field}={theirs}, the sender has {field}={senders}"


@functools.lru_cache(maxsize=8)
def _expected(info: RefitInfo) -> tuple[tuple[str, torch.Size, torch.dtype], ...]:
    """Each tensor's name, shape and torch dtype, built once per refit info."""
    return tuple((t.name, torch.Size(t.shape), torch_dtype(t.dtype)) for t in info.tensors)


def _tensor_stream(info: RefitInfo, named_tensors: Any) -> Iterator[tuple[str, Any]]:
    """Tensors in info order. A mapping is checked whole before any byte moves (a fast
    comparison per tensor; the slow path only to name what is wrong): the receivers wait in
    the header exchange meanwhile, so this is on every refit's critical path."""
    if isinstance(named_tensors, Mapping):
        unknown = sorted(set(named_tensors) - {t.name for t in info.tensors})
        if unknown:
            raise InvalidValue("tensor name", unknown, "not in the refit info")
        for meta, (name, shape, dtype) in zip(info.tensors, _expected(info)):
            tensor = named_tensors.get(name)
            if tensor is None:
                raise InvalidValue("tensor name", name, "in the refit info, missing from the"
                                   " state dict")
            if not (isinstance(tensor, torch.Tensor) and tensor.dtype == dtype
                    and tensor.shape == shape):
                check_tensor(meta, name, tensor)
        return iter([(t.name, named_tensors[t.name]) for t in info.tensors])
    return iter(named_tensors)


class TorchWeightSender(WeightSender):
    """Trainer side. On rank 0 it sends; on other trainer ranks ``send`` does nothing."""

    def __init__(self, group: CollectiveGroup, spec: CollectiveSenderSpec | None = None) -> None:
        if group.data_rank not in (0, None):
            raise InvalidValue("rank", group.rank, "a sender is a trainer rank")
        self.group = group
        self.spec = spec or CollectiveSenderSpec()
        self._kept_slots: list[torch.Tensor] = []

    def send(self, info: RefitInfo,
             named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """``named_tensors``: pairs in ``info``'s order, or a state dict (checked whole before
        any byte moves)."""
        if not self.group.is_sender:
            return
        self.group.check_usable()
        stream = _tensor_stream(info, named_tensors)
        plan = bucket_plan(info, self.spec.buffer_bytes)
        exchange_headers(self.group, self.spec, info, SENDER)
        try:
            self._send_buckets(plan, stream, checked=isinstance(named_tensors, Mapping))
        except InvalidValue as exc:
            self.group.fail("sending", f"the tensors did not match the refit info: {exc}")
            raise
        except Exception as exc:  # e.g. the trainer's tensor generator failed half way
            if not self.group.broken:
                self.group.fail("sending", exc)
            raise

    def _send_buckets(self, plan: tuple[Bucket, ...], stream: Iterator[tuple[str, Any]], *,
                      checked: bool) -> None:
        """At most ``num_buffers`` buckets in flight; a slot is refilled once its last
        broadcast is done (it is older than the ``num_buffers - 1`` still in flight)."""
        slots: list[torch.Tensor] = []
        in_flight: collections.deque = collections.deque()  # (bucket index, works), oldest first
        packed = 0
        emit = Emitter(self.group, relay_trees(self.group, self.spec))
        for index, bucket in enumerate(plan):
            tensors = [self._next_tensor(stream, entry.meta, checked) for entry in bucket.entries]
            if bucket.nbytes == 0:
                continue
            if len(in_flight) == self.spec.num_buffers:
                self._wait(in_flight.popleft(), plan)
            pieces = wire_pieces(bucket, self.group.backend)
            slot = None
            if any(piece.pack for piece in pieces):
                slots = slots or self._slots(plan)
                slot = slots[packed % len(slots)]
                packed += 1
            works = [emit(self._source(piece, bucket, tensors, slot)) for piece in pieces]
            in_flight.append((index, works))
        while in_flight:
            self._wait(in_flight.popleft(), plan)

    def _source(self, piece: Piece, bucket: Bucket, tensors: list[torch.Tensor],
                slot: torch.Tensor | None) -> torch.Tensor:
        """The bytes of one piece: packed into the slot, or the tensor's own (the work handle
        keeps them alive until sent)."""
        if piece.direct is None or piece.pack:
            if slot is None:
                raise RefitError(f"a packed piece of bytes {piece.start}-{piece.stop} has no slot")
            if piece.pack:
                run = Bucket(tuple(bucket.entries[i] for i in piece.pack), 0)
                pack_bucket(slot, run, [tensors[i] for i in piece.pack])
            if piece.direct is None:
                return slot[piece.start:piece.stop]
        entry, tensor = bucket.entries[piece.direct], tensors[piece.direct]
        if tensor.device != self.group.device:
            tensor = tensor.to(self.group.device)
        return as_bytes(tensor)[piece.start - entry.offset:piece.stop - entry.offset]

    def _wait(self, indexed_works: tuple[int, list[Any]], plan: tuple[Bucket, ...]) -> None:
        index, works = indexed_works
        wait_all(self.group, works, f"bucket {index + 1}/{len(plan)}")

    def _slots(self, plan: tuple[Bucket, ...]) -> list[torch.Tensor]:
        """The packing buffers; on the CPU kept between refits (warm pages, see packing.py)."""
        count = min(self.spec.num_buffers, sum(1 for b in plan if b.nbytes)) or 1
        size = max_bucket_bytes(plan)
        device = self.group.device
        if device.type != "cpu":
            return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
        if len(self._kept_slots) < count or any(s.numel() < size for s in self._kept_slots):
            self._kept_slots = [fresh_block(size, device) for _ in range(count)]
        return self._kept_slots[:count]

    @staticmethod
    def _next_tensor(stream: Iterator[tuple[str, Any]], meta: Any, checked: bool) -> torch.Tensor:
        try:
            name, tensor = next(stream)
        except StopIteration:
            raise InvalidValue("tensor name", meta.name, "the tensors ran out before it") from None
        if not checked:  # a mapping was checked whole before the first byte
            check_tensor(meta, name, tensor)
        return tensor

    def close(self) -> None:
        self._kept_slots = []
        self.group.close()


class TorchWeightReceiver(WeightReceiver):
    """Worker side, one per worker rank.

    ``receive`` yields views, not copies, of the block each bucket arrived in, and a block is
    never written again while any tensor handed out still views it: it is either free or a new
    one (blocks.BlockPool). So the tensors stay valid however long the consumer keeps them, and
    no copy is made out of the buffer.

    Memory: ``num_buffers`` blocks of the plan's largest bucket, reused: while the consumer
    loads bucket k, buckets k+1 .. k+num_buffers-1 are in flight, and bucket k's block is posted
    again for bucket k+num_buffers once the consumer has taken the first tensor of bucket k+1
    (it then holds none of bucket k, unless its loader keeps one: such a block is left to it
    and a new one made). A consumer that keeps every tensor (``hold_previous``: the rollback
    copy) makes a block per bucket; those are kept warm for the next refit. ``account`` counts
    the block bytes alive at every moment.
    """

    def __init__(self, group: CollectiveGroup, spec: CollectiveSenderSpec | None = None) -> None:
        if not group.data_rank:
            raise InvalidValue("rank", group.rank, "a receiver is a worker rank, not a trainer rank")
        self.group = group
        self.spec = spec or CollectiveSenderSpec()
        self._blocks = BlockPool(group.device, capacity=self.spec.num_buffers)
        # A consumer that keeps the previous refit's tensors (to roll back to) while the next
        # arrives sets this, so both sets of blocks stay warm instead of one being refaulted.
        self.hold_previous = False

    @property
    def account(self) -> ByteAccount:
        return self._blocks.account

    def receive_bound(self, info: RefitInfo) -> int:
        """The receive bytes a refit of ``info`` holds at most (a consumer that drops each
        tensor once loaded): ``num_buffers`` blocks of the largest bucket."""
        return self.spec.num_buffers * max_bucket_bytes(bucket_plan(info, self.spec.buffer_bytes))

    def receive(self, info: RefitInfo) -> Iterator[tuple[str, Any]]:
        self.group.check_usable()
        plan = bucket_plan(info, self.spec.buffer_bytes)
        exchange_headers(self.group, self.spec, info, RECEIVER)
        yield from self.group.received_whole(self._receive_buckets(plan))

    def _receive_buckets(self, plan: tuple[Bucket, ...]) -> Iterator[tuple[str, Any]]:
        moving = [index for index, bucket in enumerate(plan) if bucket.nbytes]
        depth = self.spec.num_buffers
        # The rollback copy holds every block: keep both sets warm (the previous and this one).
        self._blocks.resize(2 * len(moving) + 2 if self.hold_previous else depth)
        inflow = Inflow(self.group, relay_trees(self.group, self.spec), self._blocks, plan)
        posted = collections.deque(inflow.post_next(0) for _ in moving[:depth])
        for index, bucket in enumerate(plan):
            if bucket.nbytes == 0:
                yield from unpack_bucket(torch.empty(0, dtype=torch.uint8, device=self.group.device),
                                         bucket)
                continue
            if not posted:  # one buffer: the next bucket is posted once this one is needed
                posted.append(inflow.post_next(index))
            block = inflow.arrive(index, bucket, posted.popleft())
            for count, item in enumerate(unpack_bucket(block, bucket)):
                yield item
                # The consumer asked for this bucket's second tensor: the previous one's block
                # is free again (the next bucket of the plan goes into it).
                if count == 0 and depth > 1 and index != moving[0] and inflow.more_to_post:
                    posted.append(inflow.post_next(index))
        inflow.finish()

    def close(self) -> None:
        self._blocks.drop_kept()
        self.group.close()


def join_receiver(join: GroupJoin, engine_rank: int = 0) -> TorchWeightReceiver:
    """Join the refit group as engine rank ``engine_rank`` of a worker; return its receiver."""
    if join.backend is None:
        raise InvalidValue("backend", None, "a worker joins with gloo or nccl; fill it in first")
    group = init_group(join.host, join.port, join.rank(engine_rank), join.world_size, join.backend,
                       join.timeout_s, train_world_size=join.train_world_size)
    return TorchWeightReceiver(group, join.sender_spec)


# -- a trainer rank's side: join a refit group and send a state dict, from any torch loop. A
# trainer with several ranks (NeMo-RL's policy workers) joins on every rank: rank 0 sends; the
# others join, so the group's world size is checked, and return.
S = TypeVar("S", bound=TorchWeightSender | ShardedWeightSender)


def refit_info_of(state_dict: Mapping[str, Any]) -> RefitInfo:
    """The refit info of a state dict, in its iteration order."""
    return RefitInfo.from_state_dict_info(
        {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in state_dict.items()})


class GroupMembership(Generic[S]):
    """A trainer rank's place in a refit group: the group and this rank's sender in it, closed
    together (at ``close`` or the end of a ``with`` block)."""

    def __init__(self, group: CollectiveGroup, sender: S) -> None:
        self.group = group
        self.sender = sender

    @property
    def port(self) -> int:
        return self.group.port

    def close(self) -> None:
        self.sender.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrainerRefitSession(GroupMembership[TorchWeightSender]):
    """One trainer rank's membership of a refit group; send as many refits as needed, then close."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *,
                 train_world_size: int = 1, backend: str = "gloo", timeout_s: float = 60.0,
                 spec: CollectiveSenderSpec | None = None) -> None:
        group = init_group(host, port, rank, world_size, backend, timeout_s,
                           train_world_size=train_world_size)
        super().__init__(group, TorchWeightSender(group, spec))

    def send_state_dict(self, state_dict: Mapping[str, Any],
                        info: RefitInfo | None = None) -> RefitInfo:
        """Send ``state_dict`` (on rank 0; a no-op elsewhere); returns the refit info it used."""
        info = info if info is not None else refit_info_of(state_dict)
        self.sender.send(info, state_dict)
        return info


def send_state_dict(state_dict: Mapping[str, Any], *, host: str, port: int, rank: int,
                    world_size: int, train_world_size: int = 1, backend: str = "gloo",
                    timeout_s: float = 60.0, spec: CollectiveSenderSpec | None = None,
                    info: RefitInfo | None = None) -> RefitInfo:
    """Join the group, send one refit, leave: the one-shot form of :class:`TrainerRefitSession`."""
    with TrainerRefitSession(host, port, rank, world_size, train_world_size=train_world_size,
                             backend=backend, timeout_s=timeout_s, spec=spec) as session:
        return session.send_state_dict(state_dict, info)
