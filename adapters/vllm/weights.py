"""What a refit may load: the checkpoint's tensor names and shapes, at the engine's dtype.

vLLM fuses and repacks parameters (``qkv_proj``; on the CPU, packed kernels whose shape reads
as ``[0]``), so the live parameters cannot be checked against. What ``model.load_weights``
accepts is the checkpoint format, which the safetensors headers describe exactly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout_fleet.core.errors import EngineError, InvalidValue, WeightMismatch
from rollout_fleet.core.refit import RefitInfo, TensorMeta, dtype_name

_SAFETENSORS_HEADER_LIMIT = 100 * 2**20


def checkpoint_metas(model_dir: str | Path, dtype: str) -> dict[str, TensorMeta]:
    """Every tensor in the folder's safetensors files, reported at the engine's ``dtype``."""
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineError(f"model folder {str(folder)!r} has no .safetensors files to describe its weights")
    metas: dict[str, TensorMeta] = {}
    for path in files:
        for name, shape in _safetensors_shapes(path).items():
            metas[name] = TensorMeta(name, tuple(shape), dtype)
    return metas


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _SAFETENSORS_HEADER_LIMIT:
            raise EngineError(f"{path}: safetensors header of {length} bytes is not plausible")
        header = json.loads(f.read(length))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


def check_weights(named_tensors: Iterable[tuple[str, Any]],
                  expected: Mapping[str, TensorMeta]) -> list[tuple[str, Any]]:
    """Materialise the offered tensors and refuse any defect before one of them moves.

    A load must carry every parameter: vLLM rebuilds each fused layer (q, k and v into
    ``qkv_proj``) from all of its parts, and a layer loaded in part would be left half empty.
    """
    offered = list(named_tensors)
    try:
        metas = tuple(TensorMeta(str(name), tuple(tensor.shape), dtype_name(tensor.dtype))
                      for name, tensor in offered)
        RefitInfo(metas).check_against(expected)
    except WeightMismatch:
        raise
    except InvalidValue as error:
        raise WeightMismatch(error.field, error.value, error.rule) from None
    missing = sorted(set(expected) - {m.name for m in metas})
    if missing:
        raise WeightMismatch("tensor names", f"{len(missing)} missing, e.g. {missing[:3]}",
                             "a load must carry every parameter of the model")
    return offered
