"""The NeMo-RL driving adapter: ``DynamoGeneration``, NeMo-RL's generation contract over a fleet."""

from rollout_fleet.adapters.nemo_rl.batch import OUTPUT_KEYS, stack_outputs
from rollout_fleet.adapters.nemo_rl.config import GenerationConfig
from rollout_fleet.adapters.nemo_rl.generation import DynamoGeneration, JoinedWorker

__all__ = ["DynamoGeneration", "GenerationConfig", "JoinedWorker", "OUTPUT_KEYS", "stack_outputs"]
