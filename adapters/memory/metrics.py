"""EngineWorkerMetrics: the worker-metrics port read straight from an in-process engine."""

from __future__ import annotations

from rollout_fleet.core.errors import TransportError
from rollout_fleet.ports.metrics import WorkerLoad, WorkerMetrics


class EngineWorkerMetrics(WorkerMetrics):
    """What a memory worker would export: its rollouts in flight, its KV-cache use and the
    tokens it has generated. A dead engine's worker is gone, as a real one would be."""

    def __init__(self, worker_id: str, engine) -> None:
        self.worker_id = worker_id
        self.engine = engine

    async def sample(self) -> WorkerLoad:
        if self.engine.dead_reason() is not None:
            raise TransportError(f"worker {self.worker_id!r} is gone: {self.engine.dead_reason()}")
        return WorkerLoad(self.worker_id, inflight_requests=float(len(self.engine.in_flight)),
                          kv_cache_usage=self.engine.kv_cache_usage(),
                          generated_tokens=float(self.engine.generated_tokens))
