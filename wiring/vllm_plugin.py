"""vLLM's general plugin for rollout-fleet: registers the project's refit protocol with vLLM.

vLLM calls ``register`` in each of its processes (entry point group ``vllm.general_plugins``,
declared in pyproject.toml), so the weight-transfer engine factory of every worker knows the
``rollout_fleet_packed`` and ``rollout_fleet_sharded`` backends. The class itself is imported only when a worker builds it.
It also sets cuBLAS's and cuDNN's TF32 switches in every vLLM process from
``ROLLOUT_FLEET_ALLOW_TF32`` (set by the adapter, ``precision_env``), before any model loads.
"""

from __future__ import annotations


def register() -> None:
    """Idempotent: a process may load plugins more than once."""
    _set_tf32()
    from rollout_fleet.adapters.vllm.messages import BACKEND_NAME, SHARDED_BACKEND_NAME
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in ((BACKEND_NAME, "RolloutFleetTransferEngine"),
                      (SHARDED_BACKEND_NAME, "RolloutFleetShardedTransferEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, "rollout_fleet.wiring.vllm_transfer", cls)
        except ValueError:  # registered already in this process
            pass


def _set_tf32() -> None:
    import os

    allowed = os.environ.get("ROLLOUT_FLEET_ALLOW_TF32")
    if allowed is None:
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allowed == "1"
    torch.backends.cudnn.allow_tf32 = allowed == "1"
