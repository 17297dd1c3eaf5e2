"""The NeMo-RL driving adapter: ``FleetGeneration``, NeMo-RL's generation contract over a fleet."""

from rollout_fleet.adapters.nemo_rl.batch import OUTPUT_KEYS, stack_outputs
from rollout_fleet.adapters.nemo_rl.config import GenerationConfig
from rollout_fleet.adapters.nemo_rl.generation import FleetGeneration
from rollout_fleet.adapters.nemo_rl.membership import JoinedWorker

__all__ = ["FleetGeneration", "GenerationConfig", "JoinedWorker", "OUTPUT_KEYS", "stack_outputs"]
