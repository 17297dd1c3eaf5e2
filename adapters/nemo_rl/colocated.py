"""The driver's colocated phases: the workers that share devices with trainer ranks sleep at
the end of a generation phase and wake before the next (core/sleep.py), as NeMo-RL's
colocated loop calls ``finish_generation`` / ``prepare_for_generation(tags=...)`` on
``FleetGeneration``, which hands them to its ``ColocatedPhases``."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

from rollout_fleet.core.sleep import SleepCoordinator
from rollout_fleet.core.sleep_state import WAKE_TAGS, SleepState, wake_tags

log = logging.getLogger(__name__)


class ColocatedPhases:
    """Sleep and wake of the colocated workers among ``controls``, run on the driver's helper
    loop (``run``: a coroutine -> its result)."""

    def __init__(self, controls: Sequence[Any], colocated: Collection[str], *, level: int,
                 mode: str, timeout_s: float, run: Any) -> None:
        wanted = set(colocated)
        self._sleeps = SleepCoordinator([c for c in controls if c.worker_id in wanted],
                                        timeout_s=timeout_s)
        self._level, self._mode, self._run = level, mode, run

    @property
    def active(self) -> bool:
        return bool(self._sleeps.worker_ids)

    def keep_only(self, worker_ids: Collection[str]) -> None:
        self._sleeps.keep_only(worker_ids)

    def wake(self, tags: Any = None) -> bool:
        """Wake every colocated worker; True once each serves (or only part was asked), False
        when one woke without weights (a level-2 sleep: a refit must load them first)."""
        if not self.active:
            return True
        states = self._run(self._sleeps.wake_up(tags))
        if set(wake_tags(tags)) != set(WAKE_TAGS) or all(s.serving for s in states.values()):
            return True
        waiting = sorted(w for w, s in states.items() if not s.serving)
        log.warning("worker(s) %s woke without their weights (a level-2 sleep): they serve once"
                    " a refit loads them", waiting)
        return False

    def sleep(self) -> None:
        if self.active:
            self._run(self._sleeps.sleep(self._level, self._mode))

    def states(self) -> dict[str, SleepState]:
        return self._run(self._sleeps.states()) if self.active else {}
