"""Host memory for packed buffers that is reused instead of freshly mapped each bucket, and an
account of the receive bytes alive.

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

import time
import weakref

import torch

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
