"""The staleness bound of asynchronous RL: how far behind the fleet's weights a rollout may fall.

A rollout's version is the weight version current when the driver admitted it. The lag is
``current version - the oldest version among rollouts in flight``; with ``max_staleness = k``
the gate keeps it at most k by pacing, never by discarding work:

- a refit (the version about to advance) waits until every rollout older than
  ``new version - k`` has finished (the trainer is paced by the fleet);
- a rollout is admitted only while the lag is within k; with k = 0 it also waits for a pending
  refit, so every refit drains the fleet first (the synchronous way); with k = 1 the fleet
  keeps generating on the old weights while the trainer trains on the last batch, and a refit
  waits only for rollouts two versions old.

``None`` (the default) bounds nothing: refits and admissions never wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from rollout_fleet.core.validate import check_int_at_least


class StalenessGate:
    """Admissions and refits of one driver, on one event loop."""

    def __init__(self, max_staleness: int | None = None, current_version: int = 0) -> None:
        if max_staleness is not None:
            check_int_at_least("max_staleness", max_staleness, 0, "must be None or an int >= 0")
        check_int_at_least("current_version", current_version, 0)
        self.max_staleness = max_staleness
        self.current_version = current_version
        self._in_flight: collections.Counter[int] = collections.Counter()  # version -> rollouts
        self._refits_pending = 0  # waiting for old rollouts, or loading
        self._changed: asyncio.Condition | None = None
        self._one_refit: asyncio.Lock | None = None
        self.max_lag_seen = 0  # the largest lag this gate let happen (for reports)

    @property
    def oldest_in_flight(self) -> int | None:
        return min(self._in_flight) if self._in_flight else None

    def lag(self) -> int:
        oldest = self.oldest_in_flight
        return 0 if oldest is None else self.current_version - oldest

    @contextlib.asynccontextmanager
    async def rollout(self) -> AsyncIterator[int]:
        """Hold one admission for the rollout run inside; yields the version it is admitted at."""
        changed = self._condition()
        async with changed:
            await changed.wait_for(self._admits)
            version = self.current_version
            self._in_flight[version] += 1
        try:
            yield version
        finally:
            async with changed:
                self._in_flight[version] -= 1
                if not self._in_flight[version]:
                    del self._in_flight[version]
                changed.notify_all()

    @contextlib.asynccontextmanager
    async def refit(self) -> AsyncIterator[int]:
        """Hold the version's advance: waits until the rollouts in flight stay within the bound
        after it; yields the new version, which becomes current when the block succeeds."""
        changed = self._condition()
        async with self._one_refit:  # refits advance the version one at a time
            async with self._refit_slot(changed) as new_version:
                yield new_version

    @contextlib.asynccontextmanager
    async def _refit_slot(self, changed: asyncio.Condition) -> AsyncIterator[int]:
        async with changed:
            self._refits_pending += 1
        try:
            async with changed:
                await changed.wait_for(self._refit_fits)
            new_version = self.current_version + 1
            yield new_version
            self.current_version = new_version
            self.max_lag_seen = max(self.max_lag_seen, self.lag())
        finally:
            async with changed:
                self._refits_pending -= 1
                changed.notify_all()

    def _admits(self) -> bool:
        # A rollout admitted now is at the current version, one behind once a pending refit
        # lands: with a bound of 0 it waits for the refit (else a steady stream of rollouts
        # would hold the refit off for ever); with 1 or more it never delays a refit.
        if self.max_staleness is None:
            return True
        return self.lag() <= self.max_staleness and (
            self._refits_pending == 0 or self.max_staleness >= 1)

    def _refit_fits(self) -> bool:
        oldest = self.oldest_in_flight
        return (self.max_staleness is None or oldest is None
                or self.current_version + 1 - oldest <= self.max_staleness)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on first use, inside the loop that will use it
            self._changed = asyncio.Condition()
            self._one_refit = asyncio.Lock()
        return self._changed
