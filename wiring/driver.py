"""The composition root of every driver: what sends rollouts and refits to a fleet.

``build_generation``: the http adapter's transport, control and metrics clients (all sharing
one pooled client per event loop) under the nemo_rl adapter's FleetGeneration, for an existing
frontend URL and the workers' system ports. A fleet built by this project hands its own URLs
here (and itself as ``owned``). ``build_frontend_client``: rollouts alone, straight to a
frontend (``rollout-fleet generate``). ``build_memory_driver``: the same services over in-memory
engines (the in-memory demo).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import attrs
from rollout_fleet.adapters.http import (
    HttpCompletionsTransport,
    HttpSettings,
    HttpWorkerControl,
    HttpWorkerMetrics,
    LoopClients,
)
from rollout_fleet.adapters.http.transport import check_base_url
from rollout_fleet.adapters.nemo_rl import FleetGeneration, GenerationConfig, JoinedWorker
from rollout_fleet.core.budget import DEFAULT_ATTEMPT_FIXED_S, DEFAULT_ATTEMPT_PER_TOKEN_S
from rollout_fleet.core.clock import Clock
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit
from rollout_fleet.core.rollout_client import CompletionsTransport, RolloutClient


@attrs.frozen
class WorkerEndpoint:
    """One worker as the driver reaches it: its system port serves controls and /metrics."""

    worker_id: str
    system_url: str = attrs.field(converter=lambda url: check_base_url("system_url", url))


def build_generation(generation: GenerationConfig, *, frontend_url: str,
                     workers: Sequence[WorkerEndpoint], control_secret: str,
                     http: HttpSettings | None = None, owned: Sequence = (),
                     clock: Clock | None = None,
                     lost_workers: Callable[[], Collection[str]] | None = None,
                     joined_workers: Callable[[], Sequence[WorkerEndpoint]] | None = None,
                     ) -> FleetGeneration:
    """A driver over an existing frontend and workers; the pool holds one connection per
    allowed in-flight rollout unless ``http`` says otherwise. ``lost_workers`` is asked where
    the trainer forms its group and after a step failed, ``joined_workers`` (the fleet's
    workers now) where it sizes the group (adapters/nemo_rl/membership.py)."""
    workers = tuple(workers)
    ids = [w.worker_id for w in workers]
    if len(set(ids)) != len(ids):
        raise InvalidValue("workers", ids, "worker ids must be unique")
    clients = LoopClients(http or HttpSettings(max_in_flight=generation.max_in_flight))

    def control(worker: WorkerEndpoint) -> HttpWorkerControl:
        return HttpWorkerControl(worker.worker_id, worker.system_url, secret=control_secret,
                                 clients=clients)

    def metrics(worker: WorkerEndpoint) -> HttpWorkerMetrics:
        return HttpWorkerMetrics(worker.worker_id, worker.system_url, clients=clients)

    def joined_since(listing: Callable[[], Sequence[WorkerEndpoint]],
                     ) -> Callable[[Collection[str]], list[JoinedWorker]]:
        return lambda known: [JoinedWorker(control(w), metrics(w))
                              for w in listing() if w.worker_id not in known]

    return FleetGeneration(
        generation,
        frontend_url=check_base_url("frontend_url", frontend_url),
        transport=HttpCompletionsTransport(frontend_url, clients=clients),
        controls=[control(w) for w in workers], metrics=[metrics(w) for w in workers],
        owned=owned, clock=clock, lost_workers=lost_workers,
        joined_workers=None if joined_workers is None else joined_since(joined_workers))


@attrs.frozen
class FrontendClient:
    """Rollouts straight to a frontend, without worker controls; ``aclose`` frees the pool."""

    client: RolloutClient
    transport: CompletionsTransport

    async def aclose(self) -> None:
        await self.transport.aclose()


def build_frontend_client(frontend_url: str, *, model: str, max_in_flight: int,
                          http: HttpSettings | None = None) -> FrontendClient:
    """Rollouts to ``frontend_url``; each attempt bounded by its token budget (the default
    allowances of ``core.budget``) unless ``http`` says otherwise."""
    settings = http or HttpSettings(max_in_flight=max_in_flight,
                                    attempt_fixed_s=DEFAULT_ATTEMPT_FIXED_S,
                                    attempt_per_token_s=DEFAULT_ATTEMPT_PER_TOKEN_S)
    transport = HttpCompletionsTransport(frontend_url, settings)
    return FrontendClient(RolloutClient(transport, model=model), transport)


@attrs.frozen
class MemoryDriver:
    """One rollout client per in-memory engine and a refit coordinator over all of them."""

    clients: tuple[RolloutClient, ...]
    refits: RefitCoordinator


def build_memory_driver(engines: Sequence, *, model: str = "memory",
                        refit_timeout_s: float = 30) -> MemoryDriver:
    from rollout_fleet.adapters.memory import EngineCompletionsTransport, LocalWorkerControl

    clients = tuple(RolloutClient(EngineCompletionsTransport(e), model=model) for e in engines)
    controls = [LocalWorkerControl(f"worker-{i}", WorkerRefit(e).controls())
                for i, e in enumerate(engines)]
    return MemoryDriver(clients, RefitCoordinator(controls, timeout_s=refit_timeout_s))
