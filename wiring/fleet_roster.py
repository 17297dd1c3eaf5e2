"""Every worker a fleet has started, and for each: its share of the host's cores (its slot),
whether it is still starting, whether a replacement was started for it; and the steps of
adding one to a running fleet."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import attrs
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.ports.placement import WorkerHandle


def worker_name(index: int) -> str:
    return f"worker-{index}"


@attrs.define
class WorkerRoster:
    """Names are never reused: worker ``i`` is the ``i``-th ever started. A replacement takes
    the lost worker's slot; a worker added but not registered yet is neither lost nor live.
    One lock guards it all: a replacement may be added from the watcher's thread."""

    workers: list[WorkerHandle] = attrs.field(factory=list)  # in start order, lost ones too
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _slots: dict[str, int] = attrs.field(factory=dict)  # worker -> its share of this host's cores
    _starting: set[str] = attrs.field(factory=set)  # added workers not registered yet
    _replaced: set[str] = attrs.field(factory=set)  # lost workers a replacement was started for

    def first(self, workers: Sequence[WorkerHandle]) -> None:
        """The fleet's first workers, slot ``i`` each."""
        with self._lock:
            self.workers = list(workers)
            self._slots = {w.name: i for i, w in enumerate(self.workers)}

    def add(self, replacing: str | None, *, launch: Callable[[int, int, str], WorkerHandle],
            wait_ready: Callable[[WorkerHandle], None],
            kill: Callable[[str], None]) -> WorkerHandle:
        """One more worker: ``launch(index, slot, in_place_of)`` starts it, ``wait_ready`` waits
        until it is registered; one not ready is killed (then it counts as lost)."""
        index, slot = self.reserve(replacing)
        try:  # the placement may wait for resources: nothing else waits for it meanwhile
            worker = launch(index, slot, replacing or "")
        except BaseException:
            self.launch_failed(index, replacing)
            raise
        with self._lock:
            self.workers.append(worker)
        try:
            wait_ready(worker)
        except BaseException:
            kill(worker.name)  # stopped: it counts as lost, not as starting
            raise
        finally:
            self.registered(worker.name)
        return worker

    def control_urls(self, url_of: Callable[[WorkerHandle], str]) -> dict[str, str]:
        with self._lock:
            return {w.name: url_of(w) for w in self.workers}

    def reserve(self, replacing: str | None = None) -> tuple[int, int]:
        """The index and slot of one more worker (``replacing``: in place of that one)."""
        with self._lock:
            if replacing is not None and replacing not in self._slots:
                raise InvalidValue("replacing", replacing, f"no such worker; the fleet has "
                                   f"{sorted(self._slots)}")
            index = len(self._slots)  # every name ever used counts: names are never reused
            slot = self._slots[replacing] if replacing is not None else index
            self._slots[worker_name(index)] = slot
            self._starting.add(worker_name(index))  # neither lost nor live until registered
            if replacing is not None:
                self._replaced.add(replacing)
        return index, slot

    def launch_failed(self, index: int, replacing: str | None) -> None:
        """Its launch failed: a later round may try the replacement again."""
        self._replaced.discard(replacing)
        self._starting.discard(worker_name(index))

    def registered(self, name: str) -> None:
        """It is registered, or was stopped (then it counts as lost, not as starting)."""
        self._starting.discard(name)

    @property
    def starting(self) -> frozenset[str]:
        return frozenset(self._starting)

    def dead(self, alive: Mapping[str, bool]) -> list[str]:
        """The workers that are gone (one still starting is not among them)."""
        return sorted(name for name, up in alive.items() if not up and name not in self._starting)

    def without_replacement(self, lost: Sequence[str]) -> list[str]:
        return [name for name in lost if name not in self._replaced]
