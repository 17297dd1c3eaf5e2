"""Build a DynamoGeneration from a config: an existing frontend URL and the workers' system ports.

The composition root of the driver: the http adapter's transport, control and metrics clients
(all sharing one pooled client per event loop) under the nemo_rl adapter's DynamoGeneration.
A fleet built by this project hands its own URLs here (and itself as ``owned``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from rollout_fleet.adapters.http import (
    HttpCompletionsTransport,
    HttpSettings,
    HttpWorkerControl,
    HttpWorkerMetrics,
    LoopClients,
)
from rollout_fleet.adapters.http.transport import check_base_url
from rollout_fleet.adapters.nemo_rl import DynamoGeneration, GenerationConfig
from rollout_fleet.core.clock import Clock
from rollout_fleet.core.errors import InvalidValue


@attrs.frozen
class WorkerEndpoint:
    """One worker as the driver reaches it: its system port serves controls and /metrics."""

    worker_id: str
    system_url: str = attrs.field(converter=lambda url: check_base_url("system_url", url))


def build_generation(generation: GenerationConfig, *, frontend_url: str,
                     workers: Sequence[WorkerEndpoint], control_secret: str,
                     http: HttpSettings | None = None, owned: Sequence = (),
                     clock: Clock | None = None) -> DynamoGeneration:
    """A driver over an existing frontend and workers; the pool holds one connection per
    allowed in-flight rollout unless ``http`` says otherwise."""
    workers = tuple(workers)
    ids = [w.worker_id for w in workers]
    if len(set(ids)) != len(ids):
        raise InvalidValue("workers", ids, "worker ids must be unique")
    clients = LoopClients(http or HttpSettings(max_in_flight=generation.max_concurrency))
    return DynamoGeneration(
        generation,
        frontend_url=check_base_url("frontend_url", frontend_url),
        transport=HttpCompletionsTransport(frontend_url, clients=clients),
        controls=[HttpWorkerControl(w.worker_id, w.system_url, secret=control_secret, clients=clients)
                  for w in workers],
        metrics=[HttpWorkerMetrics(w.worker_id, w.system_url, clients=clients) for w in workers],
        owned=owned, clock=clock)
