"""Worker load sampled from a worker's Prometheus endpoint (its system port's ``/metrics``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
from rollout_fleet.adapters.http.pool import LoopClients
from rollout_fleet.adapters.http.settings import HttpSettings
from rollout_fleet.adapters.http.transport import check_base_url
from rollout_fleet.core.errors import HttpStatusError, InvalidValue
from rollout_fleet.ports.metrics import WorkerLoad, WorkerMetrics


@attrs.frozen
class MetricNames:
    """For each quantity, the metric names to look for, first present wins.

    Dynamo's worker exports ``dynamo_component_*`` series; an engine may bridge its own
    (vLLM's ``vllm:*``). Series of one name (e.g. one per data-parallel rank) are summed.
    """

    inflight_requests: tuple[str, ...] = ("dynamo_component_inflight_requests",
                                          "vllm:num_requests_running")
    kv_cache_usage: tuple[str, ...] = ("rollout_fleet_kv_cache_usage_perc",
                                       "dynamo_component_gpu_cache_usage_percent",
                                       "vllm:kv_cache_usage_perc")
    generated_tokens: tuple[str, ...] = ("rollout_fleet_generated_tokens_total",
                                         "vllm:generation_tokens_total")
    pending_requests: tuple[str, ...] = ("dynamo_work_handler_queue_depth",
                                         "vllm:num_requests_waiting")
    prefix_cache_queried_tokens: tuple[str, ...] = (
        "rollout_fleet_prefix_cache_queried_tokens_total", "vllm:prefix_cache_queries_total")
    prefix_cache_hit_tokens: tuple[str, ...] = ("rollout_fleet_prefix_cache_hit_tokens_total",
                                                "vllm:prefix_cache_hits_total")

    def every_name(self) -> tuple[str, ...]:
        return tuple(name for names in attrs.astuple(self, recurse=False) for name in names)


def parse_prometheus_text(text: str, wanted: Iterable[str]) -> dict[str, float]:
    """Sum of every sample of each wanted metric name in a Prometheus text exposition."""
    wanted = frozenset(wanted)
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        name = line[:end]
        if name not in wanted:
            continue
        rest = line[line.rfind("}") + 1:] if brace >= 0 else line[end:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _first(found: Mapping[str, float], names: Sequence[str]) -> float | None:
    for name in names:
        if name in found:
            return found[name]
    return None


class HttpWorkerMetrics(WorkerMetrics):
    def __init__(self, worker_id: str, system_url: str, *, names: MetricNames | None = None,
                 settings: HttpSettings | None = None, clients: LoopClients | None = None,
                 timeout_s: float = 5.0) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidValue("worker_id", worker_id, "must be a non-empty string")
        self.worker_id = worker_id
        self.url = check_base_url("system_url", system_url) + "/metrics"
        self.names = names or MetricNames()
        self.clients = clients or LoopClients(settings or HttpSettings())
        self.timeout_s = timeout_s

    async def sample(self) -> WorkerLoad:
        answer = await self.clients.current().get(self.url, self.timeout_s)
        if answer.status != 200:
            raise HttpStatusError(answer.status, answer.body[:2000])
        n = self.names
        found = parse_prometheus_text(answer.body.decode("utf-8", "replace"), n.every_name())
        return WorkerLoad(self.worker_id, **{
            field: _first(found, names) for field, names in attrs.asdict(n, recurse=False).items()})

    def __repr__(self) -> str:
        return f"HttpWorkerMetrics({self.worker_id!r}, {self.url!r})"
