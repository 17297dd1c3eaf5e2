"""Which checkpoint tensors a tensor-parallel vLLM rank takes as its pre-cut slice.

vLLM's linear layers cut each checkpoint tensor themselves: the loader narrows it at the
rank's offset (``tp_rank x shard size`` along the output dim for column parallel, q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` at the part's place inside the fused
parameter; along the input dim for row parallel) and copies it in. A slice cut by the plan is
exactly that narrow's result, so it goes through the model's own ``load_weights`` (and vLLM's
layerwise reload: on the CPU the layer is materialized, loaded, repacked, copied into the live
kernel tensors) with the parameter told, for this refit only, that its tensors come cut: the
unquantized layers' parameters (``ModelWeightParameter``, loaded by ``weight_loader_v2``) read
their rank from the parameter's ``tp_rank``, set to 0 so the narrow takes the whole slice at
offset 0; the older loaders (biases) skip the narrow for ``is_sharded_weight``, vLLM's flag for
pre-sharded checkpoints. The flags live on the parameters the reload materializes for the
refit (fresh ones each time), never on the live kernel tensors. Everything else is received whole and cut by vLLM as from a checkpoint (the
fallback): vocabulary-parallel embeddings and lm_head (their loader ignores the flag), a
checkpoint tensor that is already fused (the loader splits a full fused tensor), quantized or
replicated (``disable_tp``) layers, names the model does not resolve, and any tensor whose
planned slice does not fill the parameter's shard exactly.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rollout_fleet.core.refit import RefitInfo
from rollout_fleet.core.sharded_refit import EngineLayout, TensorSlice, tensor_slice

Accepts = Callable[[Any, Any, int], str | None]  # (module, parameter, E) -> "column", "row" or None


@dataclasses.dataclass(frozen=True)
class SliceTargets:
    """Per sliced checkpoint name: the vLLM module path and parameter name it loads into."""

    params: Mapping[str, tuple[str, str]]
    whole: tuple[str, ...]


def vllm_target(name: str, packed: Mapping[str, Sequence[str]]) -> tuple[str, str, bool]:
    """(module path, parameter name, whether the checkpoint tensor is itself a fused one) of a
    checkpoint name, through the model's ``packed_modules_mapping`` (q_proj -> qkv_proj)."""
    parts = name.split(".")
    if len(parts) < 2:
        return "", name, False
    prefix, module, leaf = parts[:-2], parts[-2], parts[-1]
    for fused, members in packed.items():
        if module in members:
            return ".".join([*prefix, fused]), leaf, False
    return ".".join([*prefix, module]), leaf, module in packed


def slice_targets(model: Any, info: RefitInfo, layout: EngineLayout, accepts: Accepts) -> SliceTargets:
    """Split the refit's names into those loaded as slices and those loaded whole, for the
    model as it is (``layout.whole`` is ignored: this computes it)."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    sliced, whole, by_param = {}, [], defaultdict(list)
    base = EngineLayout(layout.num_workers, layout.tensor_parallel_size, layout.num_heads,
                        layout.num_kv_heads)
    for meta in info.tensors:
        path, leaf, fused = vllm_target(meta.name, packed)
        param, module = _resolve(model, path, leaf)
        kind = None if fused or param is None else accepts(module, param, layout.tensor_parallel_size)
        cut = tensor_slice(meta, base, 0)
        if cut.kind not in ("column", "row", "vocab"):  # whole by design (norms) or unknown
            continue
        if kind is None or cut.kind != kind:
            whole.append(meta.name)
            continue
        sliced[meta.name] = (path, leaf)
        by_param[(path, leaf)].append((meta.name, kind, param))
    for parts in by_param.values():
        if not _fills(parts, info, base):
            whole += [name for name, _, _ in parts]
            for name, _, _ in parts:
                del sliced[name]
    order = {m.name: i for i, m in enumerate(info.tensors)}
    return SliceTargets(sliced, tuple(sorted(whole, key=order.__getitem__)))


def _resolve(model: Any, path: str, leaf: str) -> tuple[Any, Any]:
    try:
        module = model.get_submodule(path) if path else model
    except AttributeError:
        return None, None
    return getattr(module, leaf, None), module


def _fills(parts: list, info: RefitInfo, layout: EngineLayout) -> bool:
    """Every tensor-parallel rank's slices of the parts add up to the parameter's shard."""
    metas = {m.name: m for m in info.tensors}
    shape = tuple(parts[0][2].shape)
    for rank in range(layout.tensor_parallel_size):
        cuts = [tensor_slice(metas[name], layout, rank) for name, _, _ in parts]
        if parts[0][1] == "row":
            if len(parts) != 1 or cuts[0].shape != shape:
                return False
        elif (sum(c.shape[0] for c in cuts) != shape[0]
              or any(c.shape[1:] != shape[1:] for c in cuts)):
            return False
    return True


def mark_sliced(model: Any, targets: SliceTargets) -> None:
    """Tell each sliced parameter its tensors come cut, on the parameters the model holds now
    (vLLM's layerwise reload puts fresh ones in place at every refit: call it after)."""
    for path, leaf in set(targets.params.values()):
        module = model.get_submodule(path) if path else model
        param = getattr(module, leaf)
        param.is_sharded_weight = True  # the v1 loaders: skip the narrow
        if hasattr(param, "tp_rank"):
            param.tp_rank = 0  # the v2 loaders: narrow at offset 0, i.e. the whole slice


def cut_slice(full: Any, cut: TensorSlice) -> Any:
    """The slice of a full tensor, as the plan cuts it (the reference for a rollback)."""
    import torch

    if not cut.ranges or cut.kind in ("whole", "replicated", "fallback"):
        return full
    return torch.cat([full.narrow(cut.dim, a, b - a) for a, b in cut.ranges], dim=cut.dim)


def vllm_accepts(module: Any, param: Any, tensor_parallel_size: int) -> str | None:
    """"column" or "row" where vLLM's unquantized parallel linear layer, split over this
    engine's E ranks, loads ``param`` with a loader that honours ``is_sharded_weight``."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.parameter import ModelWeightParameter

    v1 = {ColumnParallelLinear.weight_loader: "column", MergedColumnParallelLinear.weight_loader:
          "column", QKVParallelLinear.weight_loader: "column", RowParallelLinear.weight_loader: "row"}
    v2 = {ColumnParallelLinear.weight_loader_v2: "column",
          MergedColumnParallelLinear.weight_loader_v2: "column",
          QKVParallelLinear.weight_loader_v2: "column", RowParallelLinear.weight_loader_v2: "row"}
    if (not isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            or getattr(module, "tp_size", 1) != tensor_parallel_size
            or not isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)):
        return None
    loader = _original_loader(getattr(param, "weight_loader", None))
    if getattr(loader, "__self__", None) is not module:
        return None
    function = getattr(loader, "__func__", None)
    if function in v2:
        return v2[function] if type(param) is ModelWeightParameter else None
    return v1.get(function)


def _original_loader(loader: Any) -> Any:
    """The loader under vLLM's layerwise-reload wrappers (they keep it as ``__wrapped__``)."""
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
        loader = getattr(loader, "__wrapped__", None)
    return loader


def fallback_bytes(cuts: Iterable[TensorSlice]) -> int:
    return sum(c.nbytes for c in cuts if c.kind == "fallback")
