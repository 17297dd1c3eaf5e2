"""Pack tensors into a uint8 buffer at the bucket plan's offsets, and view them back out.

How a bucket is packed was chosen by measurement on an H200 (bench/bench_gpu_pack.py, figures
in bench/RESULTS-gpu.md): on a GPU, ``torch.cat`` into the buffer, alignment gaps included, in
groups of 8 tensors, packs at 0.77-0.79 of a flat device copy's bandwidth for Llama-1B-sized
tensors and about 0.9 for Llama-8B-sized ones; one ``copy_`` per tensor is bound by Python's
cost per launch for the smaller model (0.54-0.56), and ``torch._foreach_copy_`` is slower
everywhere (0.36-0.70). On the CPU the copies are plain memory copies: a loop of ``copy_``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import BUFFER_ALIGN, Bucket, TensorMeta


@functools.lru_cache(maxsize=None)
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


def copy_tensors(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` byte for byte; targets are contiguous byte ranges."""
    for target, source in zip(targets, sources, strict=True):
        if target.numel():
            target.copy_(source)


def pack_bucket(buffer: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` (one per bucket entry, in order) into ``buffer`` at their offsets."""
    entries = [(e, t) for e, t in zip(bucket.entries, tensors, strict=True) if e.meta.nbytes]
    if not entries:
        return
    if buffer.is_cuda and all(t.device == buffer.device for _, t in entries):
        _pack_by_cat(buffer, entries)
        return
    copy_tensors([buffer[e.offset:e.offset + e.meta.nbytes] for e, _ in entries],
                 [as_bytes(t) for _, t in entries])


CAT_GROUP = 8  # tensors per torch.cat on a GPU (0: the whole bucket in one)


def _pack_by_cat(buffer: torch.Tensor, entries: list) -> None:
    """One kernel per group of tensors: their bytes with the alignment gaps between."""
    gap = torch.zeros(BUFFER_ALIGN, dtype=torch.uint8, device=buffer.device)
    group = CAT_GROUP or len(entries)
    for first in range(0, len(entries), group):
        chunk = entries[first:first + group]
        start = end = chunk[0][0].offset
        parts = []
        for entry, tensor in chunk:
            if entry.offset > end:
                parts.append(gap[:entry.offset - end])
            parts.append(as_bytes(tensor))
            end = entry.offset + entry.meta.nbytes
        torch.cat(parts, out=buffer[start:end])


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
