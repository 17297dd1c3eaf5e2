"""An in-process collective: the weight sender/receiver ports over thread-safe queues.

Stands in for torch.distributed in unit tests of the refit services. Like the real adapter it
refuses a geometry or refit-info mismatch with a clear error, and gives up after a timeout.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Iterable, Iterator
from typing import Any

from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitInfo
from rollout_fleet.ports.collective import WeightReceiver, WeightSender


class MemoryCollective:
    """The 'group': one inbox per receiver rank."""

    def __init__(self) -> None:
        self.inboxes: dict[int, queue.Queue] = {}

    def inbox(self, rank: int) -> queue.Queue:
        return self.inboxes.setdefault(rank, queue.Queue())

    def join_receiver(self, join: GroupJoin, engine_rank: int = 0) -> "MemoryWeightReceiver":
        """The transfer backend of an engine in this group (a ``MemoryEngine``'s join_receiver)."""
        return MemoryWeightReceiver(self, join.rank(engine_rank), join.sender_spec, join.timeout_s)


class MemoryWeightSender(WeightSender):
    def __init__(self, group: MemoryCollective, spec: CollectiveSenderSpec) -> None:
        self.group = group
        self.spec = spec
        self.sent_transfers = 0

    def send(self, info: RefitInfo, named_tensors: Iterable[tuple[str, Any]]) -> None:
        by_name = dict(named_tensors)
        missing = [t.name for t in info.tensors if t.name not in by_name]
        if missing:
            raise RefitError(f"the state dict lacks tensors named in the refit info: {missing[:5]}")
        payload = [(t.name, copy.deepcopy(by_name[t.name])) for t in info.tensors]
        for inbox in self.group.inboxes.values():
            inbox.put((self.spec, info, payload))
        self.sent_transfers += 1

    def close(self) -> None:
        pass


class MemoryWeightReceiver(WeightReceiver):
    def __init__(self, group: MemoryCollective, rank: int, spec: CollectiveSenderSpec,
                 timeout_s: float = 30.0) -> None:
        self.spec = spec
        self._inbox = group.inbox(rank)
        self._timeout_s = timeout_s

    def receive(self, info: RefitInfo) -> Iterator[tuple[str, Any]]:
        try:
            spec, sent_info, payload = self._inbox.get(timeout=self._timeout_s)
        except queue.Empty:
            raise RefitError(f"no weights arrived within {self._timeout_s} s") from None
        if spec != self.spec:
            raise RefitError(f"sender geometry {spec} differs from this receiver's {self.spec}")
        if sent_info != info:
            raise RefitError("the sender's refit info differs from the one this worker prepared")
        yield from payload

    def close(self) -> None:
        pass
