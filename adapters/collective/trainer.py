"""Trainer-side helper: join a refit group and send a state dict, from any torch loop.

A trainer with several ranks (NeMo-RL's policy workers) calls this on every rank: rank 0
sends; the other trainer ranks join the group, so its world size is checked, and return.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, Self, TypeVar

from rollout_fleet.adapters.collective.group import CollectiveGroup, init_group
from rollout_fleet.adapters.collective.sharded import ShardedWeightSender
from rollout_fleet.adapters.collective.transfer import TorchWeightSender
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo, dtype_name

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
