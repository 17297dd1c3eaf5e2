"""In-memory adapters: a real tiny language model in plain Python, for tests and simulations."""

from rollout_fleet.adapters.memory.engine import MemoryEngine, TinyBigramModel
from rollout_fleet.adapters.memory.transport import EngineCompletionsTransport

__all__ = ["MemoryEngine", "TinyBigramModel", "EngineCompletionsTransport"]
