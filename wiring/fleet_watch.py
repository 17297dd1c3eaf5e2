"""The fleet's watch over its workers while it runs: a thread that, every second, takes each
newly lost worker out of Dynamo's discovery and kills what is left of its processes
(``fleet_discovery.LostWorkerCleanup``) and (with ``replace_lost_workers``) starts its
replacement, trying less often while replacements fail."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import attrs
from rollout_fleet.wiring.fleet_discovery import LostWorkerCleanup

logger = logging.getLogger("rollout_fleet.fleet")
_WATCH_S = 1.0  # how often the fleet looks for lost workers
_REPLACE_BACKOFF_MAX_S = 60.0


@attrs.define
class ReplacementBackoff:
    """When the next replacement may be tried: every round while rounds succeed; after a failed
    round the wait doubles (from ``first_s``, at most ``max_s``)."""

    first_s: float = _WATCH_S
    max_s: float = _REPLACE_BACKOFF_MAX_S
    clock: Callable[[], float] = time.monotonic
    _wait_s: float = attrs.field(init=False)
    _next_try: float = 0.0

    def __attrs_post_init__(self) -> None:
        self._wait_s = self.first_s

    def due(self) -> bool:
        return self.clock() >= self._next_try

    def succeeded(self) -> None:
        self._wait_s = self.first_s

    def failed(self) -> float:
        """The next try waits longer; returns how long."""
        self._wait_s = min(2 * self._wait_s, self.max_s)
        self._next_try = self.clock() + self._wait_s
        return self._wait_s


@attrs.define
class WorkerWatcher:
    """Every ``interval_s`` until ``stopping`` is set: one round over the lost workers. A
    replacement that fails to start is lost too: the next try waits longer each time."""

    lost: Callable[[], list[str]]  # the workers that are gone (the placement asked once a round)
    cleanup: LostWorkerCleanup
    replace: Callable[[list[str]], object] | None  # None: lost workers are not replaced
    stopping: threading.Event
    interval_s: float = _WATCH_S
    backoff: ReplacementBackoff = attrs.field(factory=ReplacementBackoff)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="fleet-watcher", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _watch(self) -> None:
        while not self.stopping.wait(self.interval_s):
            if not self.round():
                return

    def round(self) -> bool:
        """One round; False when it failed because the fleet is stopping."""
        try:
            lost = self.lost()
            self.cleanup.forget_in_discovery(lost)
            self.cleanup.kill_what_is_left_of(lost)
            if self.replace is not None and self.backoff.due():
                self.replace(lost)
                self.backoff.succeeded()
        except Exception:  # noqa: BLE001 - logged; the next round tries again
            if self.stopping.is_set():
                return False
            wait_s = self.backoff.failed()
            logger.exception("watching the workers failed; next replacement try in %.0f s",
                             wait_s)
        return True
