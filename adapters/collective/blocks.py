"""Host memory for packed buffers that is reused instead of freshly mapped each bucket.

On the CPU a fresh large tensor is freshly mapped memory: each of its pages faults on first
touch, and a socket receive into never-touched pages ran several times slower than into warm
ones (bench/bench_refit_collective.py). So the sender keeps its packing slots between refits,
and the receiver recycles a block once no tensor it handed out still views it (torch's storage
use count says so), keeping at most a few blocks. On a GPU none of this is needed: the caching
allocator already recycles freed blocks, so plain allocation is used there.
"""

from __future__ import annotations

import torch

PAGE_BYTES = 4096
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def fresh_block(nbytes: int, device: torch.device) -> torch.Tensor:
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        block[::PAGE_BYTES].zero_()  # fault the pages in now, not inside the socket receive
    return block


def _references(block: torch.Tensor) -> int:
    return _use_count(block.untyped_storage()._cdata)


class BlockPool:
    """Receive blocks for one receiver: reused when free, at most ``capacity`` kept."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self._kept: list[tuple[torch.Tensor, int]] = []  # (block, its reference count when free)

    def take(self, nbytes: int, block_bytes: int) -> torch.Tensor:
        """``nbytes`` that nobody else references: a view of a kept block, or of a new one.

        New blocks get ``block_bytes`` (the plan's largest bucket), so any block fits any bucket.
        """
        if self.device.type != "cpu" or _use_count is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        free = [(b.numel(), i) for i, (b, idle) in enumerate(self._kept)
                if b.numel() >= nbytes and _references(b) == idle]
        if free:
            _, index = min(free)
            return self._kept[index][0][:nbytes]
        block = fresh_block(max(nbytes, block_bytes), self.device)
        self._kept.append((block, _references(block)))
        if len(self._kept) > self.capacity:
            # Forget the oldest block; tensors that still view it keep its memory alive.
            self._kept.pop(0)
        # Always hand out a view: a new tensor object holds a storage reference of its own, so
        # the block counts as busy until the caller and every view it makes are gone.
        return block[:nbytes]
