"""The driver's hold on new rollouts, and its per-step metric window: what NeMo-RL's loop asks
of ``FleetGeneration`` around a refit (``pause_generation_for_refit`` /
``resume_generation_after_refit``, ``pause_generation(mode)`` / ``continue_generation``) and
around a training step (``snapshot_step_metrics`` / ``get_step_metrics``).

A hold keeps rollouts from being sent, never fails them: each ``generate_async`` sample waits at
the driver until the hold is lifted; rollouts already on the workers run on (the refit's own
``mode`` says what happens to them while the weights change).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping

from rollout_fleet.core.errors import InvalidValue

# NeMo-RL's pause modes; both hold new rollouts here. ``retract`` also drops the workers'
# cached prefixes (the engines recompute them), ``in_place`` keeps them.
PAUSE_MODES = ("in_place", "retract")
_WAIT_STEP_S = 0.005


class GenerationHold:
    """``open`` is set while rollouts may be sent (read without a call on the rollout path)."""

    def __init__(self, flush_caches: Callable[[], object],
                 retried: Callable[[], Mapping[str, int]]) -> None:
        self.open = threading.Event()
        self.open.set()
        self._flush_caches = flush_caches
        self._retried = retried
        self._step_start: dict[str, int] | None = None

    def pause(self, *, clear_cache: bool) -> bool:
        self.open.clear()
        if clear_cache:
            self._flush_caches()
        return True

    def pause_in_mode(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise InvalidValue("mode", mode, f"must be one of {', '.join(PAUSE_MODES)}: a pause"
                               " here holds new rollouts and never aborts those in flight")
        self.pause(clear_cache=mode == "retract")

    def resume(self) -> bool:
        self.open.set()
        return True

    async def wait_until_open(self) -> None:
        # Polled: the hold is lifted from the trainer's thread, the waiters sit on any loop.
        while not self.open.is_set():
            await asyncio.sleep(_WAIT_STEP_S)

    def snapshot_step_metrics(self) -> None:
        self._step_start = dict(self._retried())

    def step_metrics(self) -> dict[str, float]:
        """Attempts sent again since the snapshot: in all, and by cause (HTTP status or error
        type). Ends the window; without a snapshot, counts from the driver's start."""
        start, self._step_start = self._step_start or {}, None
        now = self._retried()
        by_cause = {cause: float(n - start.get(cause, 0)) for cause, n in now.items()
                    if n != start.get(cause, 0)}
        metrics = {f"retried_attempts/{cause}": n for cause, n in sorted(by_cause.items())}
        return {"retried_attempts": float(sum(by_cause.values())), **metrics}
