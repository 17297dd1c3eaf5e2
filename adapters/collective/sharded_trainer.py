"""Trainer and engine sides of a many-source sharded refit: join the group, send or receive.

Every trainer rank calls ``ShardedTrainerSession.send_shards`` with its local shards and the
trainer layout (or ``send_dtensor_state_dict`` with a state dict of DTensors on a 1-D mesh of
the trainer ranks, ``Shard(0)`` or ``Replicate()``); every engine rank joins with
``join_sharded_receiver`` and receives its slices (``receive_declared`` with the layout its
engine declares). Before each refit trainer rank 0 declares the trainer layout and engine rank
0 the engine layout (``exchange_layouts``), so a trainer needs no knowledge of the engines: it
joins at the address the fleet's ``init_collective`` was given, at its own trainer rank, as
the packed protocol's trainer does. Every rank plans the same refit (checked by digest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from rollout_fleet.adapters.collective.group import init_group
from rollout_fleet.adapters.collective.transfer import GroupMembership
from rollout_fleet.adapters.collective.sharded import (
    ShardedWeightReceiver,
    ShardedWeightSender,
    declared_plan,
    exchange_layouts,
)
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitInfo, dtype_name
from rollout_fleet.core.sharded_refit import (
    EngineLayout,
    ShardedPlan,
    TrainerLayout,
    chunk_rows,
)


class ShardedTrainerSession(GroupMembership[ShardedWeightSender]):
    """One trainer rank's membership of a sharded refit group (every rank sends its shards).
    ``engine``: the engine layout this trainer expects, or None to take the one the engines
    declare; an expectation that differs fails the refit on every rank (the plan's digest)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, train_world_size: int,
                 engine: EngineLayout | None = None, backend: str = "gloo",
                 timeout_s: float = 60.0, spec: CollectiveSenderSpec | None = None) -> None:
        self.engine = engine
        self.last_plan: ShardedPlan | None = None
        self.spec = spec or CollectiveSenderSpec()
        group = init_group(host, port, rank, world_size, backend, timeout_s,
                           train_world_size=train_world_size, every_rank=True)
        super().__init__(group, ShardedWeightSender(group, self.spec))

    def send_shards(self, info: RefitInfo, layout: TrainerLayout,
                    local: Mapping[str, torch.Tensor]) -> ShardedPlan:
        """Send this rank's parts; ``layout`` must be the same on every rank (checked)."""
        self.group.check_usable()
        _, declared = exchange_layouts(self.group, layout if self.group.rank == 0 else None, None)
        plan = declared_plan(info, layout, self.engine or declared, self.spec.buffer_bytes)
        self.last_plan = plan
        self.sender.send(plan, local)
        return plan

    def send_dtensor_state_dict(self, state_dict: Mapping[str, Any]) -> ShardedPlan:
        info, layout, local = dtensor_shards(state_dict, self.group.rank,
                                             self.group.train_world_size)
        return self.send_shards(info, layout, local)


def dtensor_shards(state_dict: Mapping[str, Any], rank: int, train_world_size: int
                   ) -> tuple[RefitInfo, TrainerLayout, dict[str, torch.Tensor]]:
    """(info, layout, local shards) of DTensors on a 1-D mesh of the ``train_world_size``
    trainer ranks, this rank at its own place; dim-0 shards cut as torch.chunk (Shard(0))."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    info = RefitInfo.from_state_dict_info(
        {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in state_dict.items()})
    rows: list[tuple[int, ...] | None] = []
    local: dict[str, torch.Tensor] = {}
    for meta in info.tensors:
        tensor = state_dict[meta.name]
        if not isinstance(tensor, DTensor):
            raise InvalidValue(f"state dict entry {meta.name!r}", type(tensor).__name__,
                               "must be a DTensor")
        mesh, placements = tensor.device_mesh, tensor.placements
        coordinate = [int(c) for c in mesh.get_coordinate() or ()]
        if mesh.ndim != 1 or mesh.size() != train_world_size or coordinate != [rank]:
            raise InvalidValue(f"device mesh of {meta.name!r}", str(mesh),
                               f"must be 1-D over the {train_world_size} trainer ranks, this rank"
                               f" ({rank}) at place {rank}")
        if placements[0] == Shard(0) and meta.shape:
            rows.append(chunk_rows(meta.shape[0], train_world_size))
        elif isinstance(placements[0], Replicate):
            rows.append(None)
        else:
            raise InvalidValue(f"placement of {meta.name!r}", str(placements[0]),
                               "must be Shard(0) or Replicate()")
        local[meta.name] = tensor.to_local()
    return info, TrainerLayout(train_world_size, tuple(rows)), local


def join_sharded_receiver(join: GroupJoin, engine_rank: int = 0) -> ShardedWeightReceiver:
    """Join a sharded refit group as engine rank ``engine_rank`` of a worker."""
    if join.backend is None:
        raise InvalidValue("backend", None, "a worker joins with gloo or nccl; fill it in first")
    group = init_group(join.host, join.port, join.rank(engine_rank), join.world_size, join.backend,
                       join.timeout_s, train_world_size=join.train_world_size, every_rank=True)
    return ShardedWeightReceiver(group, join.sender_spec)
