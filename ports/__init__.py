"""Ports: the interfaces the core is written against, plus their contract suites.

Each port is one small abstract class. An adapter implements it; the contract suite in
``rollout_fleet.ports.contracts`` checks that it does so faithfully.
"""

from rollout_fleet.ports.clock import Clock, SystemClock
from rollout_fleet.ports.collective import WeightReceiver, WeightSender
from rollout_fleet.ports.completions import CompletionsTransport, TransportResponse
from rollout_fleet.ports.control import WorkerControl
from rollout_fleet.ports.engine import (
    EngineFacts,
    EnginePort,
    KvEventSource,
    RefitTarget,
)
from rollout_fleet.ports.placement import Placement, WorkerHandle, WorkerLaunch

__all__ = [
    "Clock", "SystemClock", "CompletionsTransport", "TransportResponse", "WorkerControl",
    "EngineFacts", "EnginePort", "KvEventSource", "RefitTarget", "WeightReceiver",
    "WeightSender", "Placement", "WorkerHandle", "WorkerLaunch",
]
