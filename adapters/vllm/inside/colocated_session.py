"""What the colocated transfer engine (``colocated_engine.py``) holds for one refit, and across
refits: the session of the refit in progress, the copies of tensors the loader still held when
their bucket was loaded, and the trainer's buffers kept open for a sender that keeps them."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Collection
from typing import Any

from rollout_fleet.adapters.vllm.inside.load_replay import RecordedCopy, RecordedFill
from rollout_fleet.core.colocated_refit import BufferHandle
from rollout_fleet.core.refit import RefitInfo, TensorMeta


class HeldCopies:
    """Bytes of held-part copies alive (each freed once the loader lets go of it)."""

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0

    def track(self, tensor: Any, nbytes: int) -> None:
        self.live += nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes


@dataclasses.dataclass
class ColocatedSession:
    """One colocated refit, from its begin step to its end or abort."""

    info: RefitInfo
    skip: frozenset[str]
    kept: list[tuple[str, Any]] | None  # the rollback copy, where one is kept
    started: float
    keep: bool = False  # the sender keeps its buffers across refits: so does the engine
    opened: dict[int, Any] = dataclasses.field(default_factory=dict)  # slot -> OpenedBuffer
    loaded: int = 0
    buckets: int = 0
    mapped_peak: int = 0
    held: HeldCopies = dataclasses.field(default_factory=HeldCopies)
    opened_count: int = 0
    slots: set[int] = dataclasses.field(default_factory=set)  # the slots this refit used
    # A refit of every bucket in one step, keeping its buffers: its load is recorded
    # (``load_replay``) into ``recorded``, or ``refusal`` says why it cannot be replayed.
    recording: bool = False
    recorded: list[RecordedCopy | RecordedFill] = dataclasses.field(default_factory=list)
    recorded_bytes: int = 0
    refusal: str = ""
    replayed: bool = False

    @functools.cached_property
    def metas(self) -> dict[str, TensorMeta]:
        """The refit info's tensors by name (made at first use)."""
        return {t.name: t for t in self.info.tensors}

    def close_opened(self) -> None:
        """Close the buffers opened for this refit alone."""
        opened, self.opened = self.opened, {}
        for buffer in opened.values():
            buffer.close()


class KeptBuffers:
    """The trainer's buffers kept open across refits for a sender that keeps them: slot ->
    (its handle, the opened buffer), reopened only when a slot's handle changes."""

    def __init__(self) -> None:
        self._by_slot: dict[int, tuple[BufferHandle, Any]] = {}

    def opened(self, handle: BufferHandle, open_new: Callable[[BufferHandle], Any]) -> Any:
        """The buffer of ``handle``'s slot: the one kept if its handle is the same, else
        ``open_new(handle)`` in place of it."""
        held = self._by_slot.get(handle.slot)
        if held is None or held[0] != handle:
            if held is not None:
                held[1].close()
            held = self._by_slot[handle.slot] = (handle, open_new(handle))
        return held[1]

    def buffer(self, slot: int) -> Any:
        return self._by_slot[slot][1]

    def buffers(self) -> list[Any]:
        return [opened for _, opened in self._by_slot.values()]

    def slots(self) -> dict[int, tuple[BufferHandle, Any]]:
        return dict(self._by_slot)

    def close_unused(self, used: Collection[int]) -> None:
        """Close those of slots the sender no longer uses."""
        for slot in set(self._by_slot) - set(used):
            self._by_slot.pop(slot)[1].close()

    def close_all(self) -> int:
        """Close every kept buffer; how many were open."""
        kept, self._by_slot = self._by_slot, {}
        for _, opened in kept.values():
            opened.close()
        return len(kept)
