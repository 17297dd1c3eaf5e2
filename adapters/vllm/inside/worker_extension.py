"""Methods injected into every vLLM worker (``worker_extension_cls``), called by collective_rpc.

They run inside the engine-core process, next to the model. Names carry a ``rollout_fleet_``
prefix: vLLM refuses an extension whose attribute clashes with the worker's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rollout_fleet.adapters.vllm.messages import RefitStats


class RolloutFleetWorkerExtension:
    # What vLLM's worker, which this class extends, has (declared, not defined: vLLM refuses
    # an extension that defines a name of the worker's).
    weight_transfer_engine: Any
    get_model: Callable[[], Any]
    vllm_config: Any

    def rollout_fleet_refit_stats(self) -> dict:
        """How this rank's last refit ended (the project's weight-transfer engine keeps it);
        vLLM's own engines keep none: a failed refit there leaves the weights torn."""
        stats = getattr(self.weight_transfer_engine, "stats", None)
        return (stats if stats is not None else RefitStats.unknown()).to_wire()

    def rollout_fleet_release_buffers(self) -> int:
        """Close the trainer's buffers this rank keeps open across colocated refits; how many."""
        release = getattr(self.weight_transfer_engine, "release_kept_buffers", None)
        return release() if release is not None else 0

    def rollout_fleet_disk_reloaded(self, failed: bool) -> None:
        """vLLM's own ``reload_weights`` replaced the weights from a folder, which this rank's
        model config names from then on. The transfer engine's rollback copy holds older
        weights: forgotten, so a refit that fails later restores the folder's. After a failed
        reload, vLLM's layerwise reload is ended: every layer back on its own tensors."""
        forget = getattr(self.weight_transfer_engine, "forget_last_good", None)
        if forget is not None:
            forget()
        if failed:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.get_model(), self.vllm_config.model_config)

    def rollout_fleet_precision(self) -> dict[str, str]:
        """What this rank computes in: its parameters' dtype and float32 matmul settings."""
        import torch

        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in self.get_model().parameters()})
        return {"params": "+".join(dtypes),
                "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "cublas_allow_tf32": str(torch.backends.cuda.matmul.allow_tf32),
                "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT", "tf32 (Triton's default)")}
