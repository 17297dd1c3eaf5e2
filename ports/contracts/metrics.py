"""The worker-metrics port's contract suite.

Provide a ``metrics_under_test`` fixture: a ``MetricsUnderTest`` whose ``metrics`` samples a
worker (or a fake of one), with ``serve_rollout()`` serving one rollout there and returning
how many tokens it generated, and ``unreachable``, a sampler of a worker that is not there.
The suite pins what the driver's metrics rely on: a sample names its worker, every quantity is
absent (None) or a finite count or fraction, the generated-token count grows by what a rollout
generated, and a worker that cannot be reached is a ``TransportError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import pytest
from rollout_fleet.core.errors import TransportError
from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.ports.metrics import WorkerLoad, WorkerMetrics


@attrs.define
class MetricsUnderTest:
    metrics: WorkerMetrics
    loop: LoopThread
    serve_rollout: Callable[[], int]
    unreachable: WorkerMetrics

    def sample(self, metrics: WorkerMetrics | None = None) -> WorkerLoad:
        return self.loop.run((metrics or self.metrics).sample(), timeout_s=30)


class MetricsContract:
    def test_a_sample_names_its_worker_and_holds_counts(
            self, metrics_under_test: MetricsUnderTest) -> None:
        load = metrics_under_test.sample()
        assert isinstance(load, WorkerLoad)
        assert load.worker_id == metrics_under_test.metrics.worker_id
        for name in ("inflight_requests", "kv_cache_usage", "generated_tokens",
                     "pending_requests"):
            value = getattr(load, name)
            assert value is None or (math.isfinite(value) and value >= 0), (name, value)
        assert load.kv_cache_usage is None or load.kv_cache_usage <= 1

    def test_generated_tokens_grow_by_what_a_rollout_generated(
            self, metrics_under_test: MetricsUnderTest) -> None:
        cut = metrics_under_test
        before = cut.sample().generated_tokens
        generated = cut.serve_rollout()
        after = cut.sample().generated_tokens
        assert generated >= 1 and before is not None and after is not None
        assert after - before >= generated

    def test_a_worker_that_is_not_there_is_a_transport_error(
            self, metrics_under_test: MetricsUnderTest) -> None:
        with pytest.raises(TransportError):
            metrics_under_test.sample(metrics_under_test.unreachable)
