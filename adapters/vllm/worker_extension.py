"""Methods injected into every vLLM worker (``worker_extension_cls``), called by collective_rpc.

They run inside the engine-core process, next to the model. Names carry a ``rollout_fleet_``
prefix: vLLM refuses an extension whose attribute clashes with the worker's own.
"""

from __future__ import annotations

import math


class RolloutFleetWorkerExtension:
    def rollout_fleet_parameters(self) -> dict[str, tuple[list[int], str]]:
        """The live model's parameters as vLLM holds them (fused, possibly repacked)."""
        model = self.get_model()
        return {name: (list(p.shape), str(p.dtype).removeprefix("torch."))
                for name, p in model.named_parameters()}

    def rollout_fleet_load_weights(self, manifest: tuple[str, int, list]) -> int:
        """Load checkpoint-format tensors in place, layer by layer.

        ``manifest = (path, nbytes, [(name, dtype, shape, offset), ...])``: the tensors lie in
        one shared-memory file written by the adapter; they are mapped here, not copied, and
        ``load_weights`` copies each into its parameter.

        A bare ``model.load_weights`` is not enough on the CPU backend: weights are repacked
        after loading, and the layerwise reload redoes that processing for each layer.
        The caller has already checked every name, shape and dtype.
        """
        import torch
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        path, nbytes, entries = manifest
        block = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        model = self.get_model()

        def tensors():
            for name, dtype_name, shape, offset in entries:
                dtype = getattr(torch, dtype_name)
                raw = block[offset:offset + math.prod(shape) * dtype.itemsize]
                yield name, raw.view(dtype).reshape(shape)

        initialize_layerwise_reload(model)
        model.load_weights(tensors())
        finalize_layerwise_reload(model, self.model_config)
        return len(entries)
