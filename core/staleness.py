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

One gate serves a whole driver: rollouts may be admitted from any event loop or thread (each
``generate_async`` caller's loop), and a refit may be held from a plain thread (the trainer's
synchronous ``update_weights_from_collective``). State sits under one lock; a waiter is woken on
its own loop (or thread) whenever the state changes, and checks again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from rollout_fleet.core.clock import Clock, SystemClock
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.validate import check_int_at_least

T = TypeVar("T")


class StalenessTimeout(RolloutFleetError):
    """A refit waited longer than it was allowed for old rollouts to finish."""


class StalenessGate:
    """Admissions and refits of one driver, from any loop or thread."""

    def __init__(self, max_staleness: int | None = None, current_version: int = 0, *,
                 clock: Clock | None = None) -> None:
        if max_staleness is not None:
            check_int_at_least("max_staleness", max_staleness, 0, "must be None or an int >= 0")
        check_int_at_least("current_version", current_version, 0)
        self.max_staleness = max_staleness
        self.bounded = max_staleness is not None  # read per rollout: a field, not a property
        self.current_version = current_version
        self._clock = clock or SystemClock()
        self._in_flight: collections.Counter[int] = collections.Counter()  # version -> rollouts
        self._refit_pending = False  # waiting for old rollouts, or loading: one at a time
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], object]] = []  # each wakes one waiter to check again
        self.max_lag_seen = 0  # the largest lag this gate let happen (for reports)

    @property
    def oldest_in_flight(self) -> int | None:
        return min(self._in_flight) if self._in_flight else None

    def lag(self) -> int:
        oldest = self.oldest_in_flight
        return 0 if oldest is None else self.current_version - oldest

    # -- rollouts -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def rollout(self) -> AsyncIterator[int]:
        """Hold one admission for the rollout run inside; yields the version it is admitted at."""
        version = await self._await(self._try_admit)
        try:
            yield version
        finally:
            with self._lock:
                self._in_flight[version] -= 1
                if not self._in_flight[version]:
                    del self._in_flight[version]
            self._wake_all()

    def _try_admit(self) -> int | None:  # called under the lock
        if not self._admits():
            return None
        version = self.current_version
        self._in_flight[version] += 1
        return version

    # -- refits ---------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def refit(self) -> AsyncIterator[int]:
        """Hold the version's advance: waits until the rollouts in flight stay within the bound
        after it; yields the new version, which becomes current when the block succeeds."""
        await self._await(self._try_hold_refit)
        succeeded = False
        try:
            new_version = await self._await(self._try_start_refit)
            yield new_version
            succeeded = True
        finally:
            self._end_refit(succeeded)

    def begin_refit(self, timeout_s: float | None = None) -> int:
        """The blocking form, for a trainer's thread: returns the new version once the refit
        fits; ``end_refit`` must follow. Never call it from a loop that admits rollouts."""
        self._block(self._try_hold_refit, timeout_s)
        try:
            return self._block(self._try_start_refit, timeout_s)
        except BaseException:
            self._end_refit(False)
            raise

    def end_refit(self, succeeded: bool) -> None:
        """The version advances only when the refit succeeded (a failed one kept the old)."""
        self._end_refit(succeeded)

    def _try_hold_refit(self) -> bool | None:  # called under the lock
        if self._refit_pending:
            return None
        self._refit_pending = True
        return True

    def _try_start_refit(self) -> int | None:  # called under the lock
        return self.current_version + 1 if self._refit_fits() else None

    def _end_refit(self, succeeded: bool) -> None:
        with self._lock:
            if succeeded:
                self.current_version += 1
                self.max_lag_seen = max(self.max_lag_seen, self.lag())
            self._refit_pending = False
        self._wake_all()

    # -- the rules ------------------------------------------------------------------------------
    def _admits(self) -> bool:
        # A rollout admitted now is at the current version, one behind once a pending refit
        # lands: with a bound of 0 it waits for the refit (else a steady stream of rollouts
        # would hold the refit off for ever); with 1 or more it never delays a refit.
        if self.max_staleness is None:
            return True
        return self.lag() <= self.max_staleness and (
            not self._refit_pending or self.max_staleness >= 1)

    def _refit_fits(self) -> bool:
        oldest = self.oldest_in_flight
        return (self.max_staleness is None or oldest is None
                or self.current_version + 1 - oldest <= self.max_staleness)

    # -- waiting --------------------------------------------------------------------------------
    def _attempt(self, attempt: Callable[[], T | None], wake: Callable[[], object]) -> T | None:
        """``attempt`` under the lock: its outcome, or None (it cannot go on yet) with ``wake``
        left to be called at the next change of state."""
        with self._lock:
            outcome = attempt()
            if outcome is None:
                self._waiters.append(wake)
            return outcome

    async def _await(self, attempt: Callable[[], T | None]) -> T:
        with self._lock:  # the common case, every rollout's admission: nothing to wait for
            outcome = attempt()
        if outcome is not None:
            return outcome
        loop = asyncio.get_running_loop()
        while True:
            woken: asyncio.Future[None] = loop.create_future()
            outcome = self._attempt(attempt, functools.partial(loop.call_soon_threadsafe,
                                                               _settle, woken))
            if outcome is not None:
                return outcome
            await woken

    def _block(self, attempt: Callable[[], T | None], timeout_s: float | None) -> T:
        deadline = None if timeout_s is None else self._clock.monotonic() + timeout_s
        while True:
            woken = threading.Event()
            outcome = self._attempt(attempt, woken.set)
            if outcome is not None:
                return outcome
            left = None if deadline is None else deadline - self._clock.monotonic()
            if left is not None and (left <= 0 or not woken.wait(left)):
                raise StalenessTimeout(
                    f"a refit waited {timeout_s:.0f} s for rollouts older than the staleness "
                    f"bound ({self.max_staleness}) to finish")
            if left is None:
                woken.wait()

    def _wake_all(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            try:
                wake()
            except RuntimeError:  # that waiter's loop has closed: nobody is left to wake
                pass


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)

