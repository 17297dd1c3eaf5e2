"""Pack tensors into a uint8 buffer at the bucket plan's offsets, and view them back out.

On a GPU, one ``torch._foreach_copy_`` packs a whole bucket in a few kernel launches instead
of one launch per tensor (bench/bench_gpu_pack.py measures the difference); on the CPU it is
the same loop of copies, so it is used everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import Bucket, TensorMeta


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidValue("dtype", name, "torch has no dtype of that name")
    return dtype


def check_tensor(meta: TensorMeta, name: str, tensor: torch.Tensor) -> None:
    """The tensor offered for ``meta`` has its name, shape and dtype."""
    if name != meta.name:
        raise InvalidValue("tensor name", name, f"the refit info expects {meta.name!r} at this point")
    if not isinstance(tensor, torch.Tensor):
        raise InvalidValue(f"tensor {name!r}", type(tensor).__name__, "must be a torch.Tensor")
    if tuple(tensor.shape) != meta.shape:
        raise InvalidValue(f"shape of {name!r}", list(tensor.shape),
                           f"the refit info says {list(meta.shape)}")
    if tensor.dtype != torch_dtype(meta.dtype):
        raise InvalidValue(f"dtype of {name!r}", str(tensor.dtype).removeprefix("torch."),
                           f"the refit info says {meta.dtype}")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's elements (a contiguous copy first if it is strided)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(buffer: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` (one per bucket entry, in order) into ``buffer`` at their offsets."""
    targets, sources = [], []
    for entry, tensor in zip(bucket.entries, tensors, strict=True):
        if entry.meta.nbytes:
            targets.append(buffer[entry.offset:entry.offset + entry.meta.nbytes])
            sources.append(as_bytes(tensor))
    if targets:
        torch._foreach_copy_(targets, sources)


def unpack_bucket(block: torch.Tensor, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` for each entry: views of ``block``, typed and shaped per the plan."""
    for entry in bucket.entries:
        meta = entry.meta
        dtype = torch_dtype(meta.dtype)
        if meta.nbytes == 0:
            yield meta.name, torch.empty(meta.shape, dtype=dtype, device=block.device)
            continue
        raw = block[entry.offset:entry.offset + meta.nbytes]
        yield meta.name, raw.view(dtype).reshape(meta.shape)
