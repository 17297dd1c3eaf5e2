"""Worker metrics port: a sample of one worker's load, read from what the worker exports."""

from __future__ import annotations

from abc import ABC, abstractmethod

import attrs


@attrs.frozen
class WorkerLoad:
    """One sample. A field is None when the worker does not export that quantity."""

    worker_id: str
    inflight_requests: float | None = None
    kv_cache_usage: float | None = None  # fraction of the KV cache in use, 0..1
    generated_tokens: float | None = None  # cumulative count since the worker started
    pending_requests: float | None = None  # taken by the worker, not yet running in the engine
    # Cumulative token counts of the requests whose engine told its prefix-cache hit: their
    # prompt tokens, and how many of those the cache already held (hits / queried = hit rate).
    prefix_cache_queried_tokens: float | None = None
    prefix_cache_hit_tokens: float | None = None


class WorkerMetrics(ABC):
    worker_id: str

    @abstractmethod
    async def sample(self) -> WorkerLoad:
        """Read the worker's current load; raises ``TransportError`` when it cannot be reached."""
