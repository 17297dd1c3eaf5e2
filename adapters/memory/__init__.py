"""In-memory adapters: a real tiny language model in plain Python, for tests and simulations."""

from rollout_fleet.adapters.memory.collective import (
    MemoryCollective,
    MemoryWeightReceiver,
    MemoryWeightSender,
)
from rollout_fleet.adapters.memory.control import LocalWorkerControl
from rollout_fleet.adapters.memory.engine import MemoryEngine, TinyBigramModel
from rollout_fleet.adapters.memory.metrics import EngineWorkerMetrics
from rollout_fleet.adapters.memory.transport import EngineCompletionsTransport

__all__ = ["MemoryEngine", "TinyBigramModel", "EngineCompletionsTransport", "MemoryCollective",
           "MemoryWeightReceiver", "MemoryWeightSender", "LocalWorkerControl", "EngineWorkerMetrics"]
