"""Packed buffers: how tensors are packed into a uint8 buffer at the bucket plan's offsets and
viewed back out, and the host memory those buffers live in.

How a bucket is packed was chosen by measurement on an H200 (bench/bench_gpu_pack.py, figures
in bench/RESULTS-gpu.md): on a GPU, ``torch.cat`` into the buffer, alignment gaps included, in
groups of 8 tensors, packs at 0.77-0.79 of a flat device copy's bandwidth for Llama-1B-sized
tensors and about 0.9 for Llama-8B-sized ones; one ``copy_`` per tensor is bound by Python's
cost per launch for the smaller model (0.54-0.56), and ``torch._foreach_copy_`` is slower
everywhere (0.36-0.70). On the CPU the copies are plain memory copies: a loop of ``copy_``.

On the CPU a fresh large tensor is freshly mapped memory: each of its pages faults on first
touch, and a socket receive into never-touched pages ran several times slower than into warm
ones (bench/bench_refit_collective.py). So the sender keeps its packing slots between refits,
and the receiver recycles a block once no tensor it handed out still views it (torch's storage
use count says so), keeping at most ``capacity`` blocks. On a GPU the caching allocator already
recycles freed blocks, so plain allocation is used there.

Every block a pool hands out is counted until the last tensor viewing it is gone (a view holds
its base tensor, so a weak reference to the block says when): ``live_bytes`` is what the
receiver's buffers hold at this moment, ``peak_bytes`` the most since ``reset_peak``.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Iterator, Sequence

import torch
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import BUFFER_ALIGN, Bucket, TensorMeta

PAGE_BYTES = 4096
RELEASE_PATIENCE_S = 0.005
RELEASE_POLL_S = 0.0002
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def fresh_block(nbytes: int, device: torch.device) -> torch.Tensor:
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        block[::PAGE_BYTES].zero_()  # fault the pages in now, not inside the socket receive
    return block


def _references(block: torch.Tensor) -> int:
    """Tensors holding ``block``'s storage (a pool reuses blocks only where torch counts them)."""
    if _use_count is None:
        raise RuntimeError("this torch does not count a storage's uses")
    return _use_count(block.untyped_storage()._cdata)


class ByteAccount:
    """Bytes of blocks alive (held by the pool or by any tensor viewing them), and the peak."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.blocks_made = 0

    def track(self, block: torch.Tensor) -> None:
        nbytes = block.numel() * block.element_size()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.blocks_made += 1
        weakref.finalize(block, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


class BlockPool:
    """Receive blocks for one receiver: reused when free, at most ``capacity`` kept."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self.account = ByteAccount()
        self._kept: list[tuple[torch.Tensor, int]] = []  # (block, its reference count when free)

    def take(self, nbytes: int, block_bytes: int) -> torch.Tensor:
        """``nbytes`` that nobody else references: a view of a kept block, or of a new one.

        New blocks get ``block_bytes`` (the plan's largest bucket), so any block fits any bucket.
        """
        if self.device.type != "cpu" or _use_count is None:
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.account.track(block)
            return block[:nbytes]
        index = self._free(nbytes)
        if index is None and len(self._kept) >= self.capacity:
            index = self._free_soon(nbytes)
        if index is not None:
            return self._kept[index][0][:nbytes]
        block = fresh_block(max(nbytes, block_bytes), self.device)
        self.account.track(block)
        self._kept.append((block, _references(block)))
        while len(self._kept) > self.capacity:
            # Forget the oldest block; tensors that still view it keep its memory alive.
            self._kept.pop(0)
        # Always hand out a view: a new tensor object holds a storage reference of its own, so
        # the block counts as busy until the caller and every view it makes are gone.
        return block[:nbytes]

    def _free(self, nbytes: int) -> int | None:
        free = [(b.numel(), i) for i, (b, idle) in enumerate(self._kept)
                if b.numel() >= nbytes and _references(b) == idle]
        return min(free)[1] if free else None

    def _free_soon(self, nbytes: int) -> int | None:
        """A completed collective's work may still hold its views for a moment (gloo's worker
        thread drops them after marking the work done): wait that moment, bounded, before
        making a block more than the pool's capacity."""
        deadline = time.monotonic() + RELEASE_PATIENCE_S
        while time.monotonic() < deadline:
            time.sleep(RELEASE_POLL_S)
            index = self._free(nbytes)
            if index is not None:
                return index
        return None

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` blocks from now on (the oldest beyond it are forgotten)."""
        self.capacity = capacity
        del self._kept[:max(0, len(self._kept) - capacity)]

    def drop_kept(self) -> None:
        """Forget every kept block (those no tensor views are freed now)."""
        self._kept = []


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
