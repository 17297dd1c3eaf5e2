"""What a refit may load: the checkpoint's tensor names and shapes, at the engine's dtype.

vLLM fuses and repacks parameters (``qkv_proj``; on the CPU, packed kernels whose shape reads
as ``[0]``), so the live parameters cannot be checked against. What ``model.load_weights``
accepts is the checkpoint format, which the safetensors headers describe exactly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

from rollout_fleet.core.errors import EngineError, InvalidValue, WeightMismatch
from rollout_fleet.core.refit import RefitInfo, TensorMeta

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


# Names a trainer's state dict holds that vLLM's loader skips when the model ties its output
# layer to its embedding (checkpoint name -> the name it is tied to).
TIED_NAMES = {"lm_head.weight": "model.embed_tokens.weight"}


def tied_metas(model_dir: str | Path, metas: dict[str, TensorMeta]) -> dict[str, TensorMeta]:
    """What a tied model's refit may also carry and vLLM's loader ignores: ``lm_head.weight``
    in the embedding's shape when ``config.json`` says ``tie_word_embeddings`` and the
    checkpoint holds no such tensor."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    text = config.get("text_config") or {}
    if not (config.get("tie_word_embeddings") or text.get("tie_word_embeddings")):
        return {}
    return {name: TensorMeta(name, metas[source].shape, metas[source].dtype)
            for name, source in TIED_NAMES.items() if name not in metas and source in metas}


def check_complete(info: RefitInfo, metas: Mapping[str, TensorMeta],
                   ignored: Mapping[str, TensorMeta] | None = None) -> None:
    """Every name, shape and dtype is the engine's, and every parameter is there: vLLM rebuilds
    each fused layer (q, k and v into ``qkv_proj``) from all its parts, and a layer refit in
    part would be left half empty. ``ignored`` names (a tied ``lm_head.weight``) may come or
    not: vLLM's loader skips them."""
    try:
        info.check_against({**(ignored or {}), **metas})
    except WeightMismatch:
        raise
    except InvalidValue as error:
        raise WeightMismatch(error.field, error.value, error.rule) from None
    missing = sorted(set(metas) - {t.name for t in info.tensors})
    if missing:
        raise WeightMismatch("tensor names", missing[:5], f"{len(missing)} of the engine's"
                             " parameters are missing: a refit carries every one")


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _SAFETENSORS_HEADER_LIMIT:
            raise EngineError(f"{path}: safetensors header of {length} bytes is not plausible")
        header = json.loads(f.read(length))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


