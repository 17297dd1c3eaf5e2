"""The worker host's side of the vLLM backend: ``VllmEngine`` and its typed config."""

from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig
from rollout_fleet.adapters.vllm.host.engine import VllmEngine


def engine_from_config(config: dict) -> VllmEngine:
    """The engine for a config dict (``VllmEngineConfig`` keys; ``model`` required)."""
    return VllmEngine(VllmEngineConfig.from_mapping(config))


__all__ = ["VllmEngine", "VllmEngineConfig", "engine_from_config"]
