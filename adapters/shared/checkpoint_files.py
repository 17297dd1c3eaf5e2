"""A checkpoint folder read as ``core.checkpoint_check`` judges it: its entries, each
``*.safetensors`` file's size and header (never its data), and the index's weight map. What
cannot be read is refused here, naming the file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from rollout_fleet.core.checkpoint_check import (
    INDEX_NAME, SAFETENSORS_PREFIX, CheckpointListing, SafetensorsFile, StoredTensor,
    check_finished,
)
from rollout_fleet.core.errors import IncompleteCheckpoint

HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on a header
# safetensors' dtype names -> the core's (torch's, without "torch.").
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def read_checkpoint(folder: str | os.PathLike[str]) -> CheckpointListing:
    """The folder as read; a staging folder or file is refused before any header is read."""
    path = Path(folder)
    if not path.is_dir():
        raise IncompleteCheckpoint("checkpoint", str(folder), "is not a folder this process can"
                                   " read")
    entries = tuple(sorted(os.listdir(path)))
    check_finished(CheckpointListing(str(path), entries, ()))
    files = tuple(read_safetensors(path / name) for name in entries
                  if name.endswith(".safetensors") and (path / name).is_file())
    index = read_index(path / INDEX_NAME) if INDEX_NAME in entries else None
    return CheckpointListing(str(path), entries, files, index)


def read_safetensors(path: Path) -> SafetensorsFile:
    """A file's size and header; a file too short for its header, or whose header is not a
    safetensors header, is refused naming it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(SAFETENSORS_PREFIX)
        if len(prefix) < SAFETENSORS_PREFIX:
            raise IncompleteCheckpoint("checkpoint file", str(path), f"is truncated: {size}"
                                       " bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(HEADER_LIMIT, size - SAFETENSORS_PREFIX):
            raise IncompleteCheckpoint("checkpoint file", str(path), f"is truncated or not"
                                       f" safetensors: its header would take {length} bytes of"
                                       f" the {size - SAFETENSORS_PREFIX} after its length")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise IncompleteCheckpoint("checkpoint file", str(path), "has a header that is not a"
                                   " JSON object: a corrupt or foreign file")
    tensors = tuple(_stored(path, name, entry) for name, entry in header.items()
                    if name != "__metadata__")
    return SafetensorsFile(path.name, size, length, tensors)


def _stored(path: Path, name: str, entry: Any) -> StoredTensor:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        dims = tuple(int(d) for d in shape)
        if not isinstance(dtype, str) or any(d < 0 for d in dims):
            raise ValueError(dtype)
        return StoredTensor(name, SAFETENSORS_DTYPES.get(dtype, f"safetensors {dtype}"), dims,
                            int(begin), int(end))
    except (KeyError, TypeError, ValueError):
        raise IncompleteCheckpoint("checkpoint file", str(path), f"describes tensor {name!r}"
                                   " with a malformed header entry") from None


def read_index(path: Path) -> dict[str, str]:
    """The index's weight map: tensor name -> file name."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise IncompleteCheckpoint("checkpoint file", str(path), "is not an index with a"
                                   " weight_map of tensor name -> file name")
    return dict(weight_map)
