"""The door's async face of its ``TrajectoryStore``: every call runs in one thread of its own
(a write may wait for another door process's), never on the event loop; the store's clock is
the door's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rollout_fleet.core.agent_turns import RecordedTurn, TrajectoryStore
from rollout_fleet.core.clock import Clock, SystemClock

_Result = TypeVar("_Result")


class TurnRecords:
    def __init__(self, store: TrajectoryStore, clock: Clock | None = None) -> None:
        self.store = store
        self.clock = clock or SystemClock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="door-store")

    async def latest(self, trajectory: str | None) -> RecordedTurn | None:
        """The trajectory's last turn; None for none named, its first, or one forgotten."""
        return await self._read_named(trajectory, self.store.latest)

    async def record(self, trajectory: str, turn: RecordedTurn) -> None:
        await self._run(lambda now: self.store.record(trajectory, turn, now))

    async def end(self, trajectory: str) -> bool:
        return await self._run(lambda _now: self.store.end(trajectory))

    async def pinned_worker(self, session: str | None) -> int | None:
        return await self._read_named(session, self.store.pinned_worker)

    async def pin(self, session: str, worker: int) -> None:
        await self._run(lambda now: self.store.pin(session, worker, now))

    async def _read_named(self, name: str | None,
                          read: Callable[[str, float], _Result]) -> _Result | None:
        """``read(name, now)`` in the store's thread; None where no name was given."""
        if name is None:
            return None
        named = name
        return await self._run(lambda now: read(named, now))

    async def _run(self, call: Callable[[float], _Result]) -> _Result:
        now = self.clock.monotonic()
        return await asyncio.get_running_loop().run_in_executor(self._thread, call, now)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
