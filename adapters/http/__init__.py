"""HTTP adapters: the completions transport, the worker-control client, worker metrics.

One pooled client per event loop, sized from the configured in-flight rollouts; the stack
under it (a pooled aiohttp session by default, or httpx) is chosen by measurement
(bench/bench_driver.py).
"""

from rollout_fleet.adapters.http.control import HttpWorkerControl
from rollout_fleet.adapters.http.metrics import (
    HttpWorkerMetrics,
    MetricNames,
    parse_prometheus_text,
)
from rollout_fleet.adapters.http.pool import LoopClients
from rollout_fleet.adapters.http.settings import CLIENT_KINDS, ClientKind, HttpSettings
from rollout_fleet.adapters.http.transport import (
    HttpCompletionsTransport,
    parse_retry_after,
)

__all__ = [
    "CLIENT_KINDS", "ClientKind", "HttpSettings", "LoopClients", "HttpCompletionsTransport",
    "HttpWorkerControl", "HttpWorkerMetrics", "MetricNames", "parse_prometheus_text",
    "parse_retry_after",
]
