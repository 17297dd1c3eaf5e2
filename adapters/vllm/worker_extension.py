"""Methods injected into every vLLM worker (``worker_extension_cls``), called by collective_rpc.

They run inside the engine-core process, next to the model. Names carry a ``rollout_fleet_``
prefix: vLLM refuses an extension whose attribute clashes with the worker's own.
"""

from __future__ import annotations

from collections.abc import Iterable


class RolloutFleetWorkerExtension:
    def rollout_fleet_parameters(self) -> dict[str, tuple[list[int], str]]:
        """The live model's parameters as vLLM holds them (fused, possibly repacked)."""
        model = self.get_model()
        return {name: (list(p.shape), str(p.dtype).removeprefix("torch."))
                for name, p in model.named_parameters()}

    def rollout_fleet_load_weights(self, packed: Iterable[tuple[str, str, list[int], bytes]]) -> int:
        """Load checkpoint-format tensors in place, layer by layer.

        Tensors arrive as ``(name, dtype, shape, raw bytes)``: plain values that cross vLLM's
        RPC serialisation unchanged (a tensor nested in a list does not).

        A bare ``model.load_weights`` is not enough on the CPU backend: weights are repacked
        after loading, and the layerwise reload redoes that processing for each layer.
        The caller has already checked every name, shape and dtype.
        """
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.get_model()
        count = 0

        def counted():
            nonlocal count
            for name, dtype, shape, data in packed:
                count += 1
                yield name, _unpack(dtype, shape, data)

        initialize_layerwise_reload(model)
        model.load_weights(counted())
        finalize_layerwise_reload(model, self.model_config)
        return count


def _unpack(dtype: str, shape: list[int], data: bytes):
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype))
    return flat.reshape(shape)
