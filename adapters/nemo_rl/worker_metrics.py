"""The driver's per-worker metric timelines: each worker's load sampled now, or every
``interval`` seconds on the driver's helper loop, kept as ``(seconds since start, value)``
points per quantity and worker (what NeMo-RL's ``get_logger_metrics`` returns)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.ports.metrics import WorkerLoad, WorkerMetrics

log = logging.getLogger(__name__)
METRIC_KEYS = ("inflight_requests", "kv_cache_usage", "generated_tokens", "pending_requests",
               "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")


class MetricTimelines:
    """Samples ``sources`` (one per worker) on ``helper`` (the driver's ``LoopThread``)."""

    def __init__(self, sources: Sequence[WorkerMetrics], helper: LoopThread, *,
                 interval_s: float) -> None:
        self.sources = tuple(sources)
        self._helper = helper
        self._interval_s = interval_s
        self._sampler: Any = None
        self._started_at = time.monotonic()
        # Held while the sources change, a sample's answers are recorded (on the helper loop's
        # thread) or the timelines are read: a worker left out gets no point after
        # ``keep_only`` returns, even from a sample already in flight.
        self._membership = threading.Lock()
        self._timelines: dict[str, dict[str, list]] = {
            key: {m.worker_id: [] for m in self.sources} for key in METRIC_KEYS}

    def keep_only(self, worker_ids: Collection[str]) -> None:
        with self._membership:
            self.sources = tuple(m for m in self.sources if m.worker_id in worker_ids)

    def add(self, sources: Sequence[WorkerMetrics]) -> None:
        """Sampled from now on too (the sampler starts here if it had no worker to sample)."""
        with self._membership:
            self.sources = (*self.sources, *sources)
            for per_worker in self._timelines.values():
                for source in sources:
                    per_worker.setdefault(source.worker_id, [])
        self.start()

    def timelines(self) -> dict[str, dict[str, list[tuple[float, float]]]]:
        with self._membership:
            return {key: {w: list(points) for w, points in per_worker.items()}
                    for key, per_worker in self._timelines.items()}

    def drain_latest(self) -> dict[str, dict[str, list[tuple[float, float]]]]:
        """Each worker's newest point per quantity, the rest dropped: a frequent poller gets a
        bounded answer (``generated_tokens`` is a running count, so deltas stay readable)."""
        with self._membership:
            latest = {key: {w: points[-1:] for w, points in per_worker.items() if points}
                      for key, per_worker in self._timelines.items()}
            self._clear()
        return latest

    def clear(self) -> None:
        with self._membership:
            self._clear()

    def _clear(self) -> None:
        for per_worker in self._timelines.values():
            for points in per_worker.values():
                points.clear()

    def sample_now(self) -> list[WorkerLoad]:
        return self._helper.run(self._sample_once())

    def start(self) -> None:
        """Sample every ``interval_s`` from now on (once started, it runs until ``stop``); the
        driver starts it once, as it is built."""
        if self._sampler is not None or not self.sources or self._interval_s <= 0:
            return
        self._sampler = self._helper.spawn(self._sample_forever())

    def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()

    async def _sample_once(self) -> list[WorkerLoad]:
        sources = self.sources
        answers = await asyncio.gather(*(m.sample() for m in sources), return_exceptions=True)
        at = time.monotonic() - self._started_at
        loads = []
        for source, answer in zip(sources, answers):
            if isinstance(answer, BaseException):
                log.warning("metrics of worker %s unavailable: %s", source.worker_id, answer)
                continue
            loads.append(answer)
        with self._membership:
            members = {m.worker_id for m in self.sources}
            for answer in loads:
                if answer.worker_id in members:  # not left out while the sample was in flight
                    self._record(at, answer)
        return loads

    def _record(self, at: float, answer: WorkerLoad) -> None:
        for key in METRIC_KEYS:
            value = getattr(answer, key)
            if value is not None:
                self._timelines[key][answer.worker_id].append((at, value))

    async def _sample_forever(self) -> None:
        while True:
            await self._sample_once()
            await asyncio.sleep(self._interval_s)
