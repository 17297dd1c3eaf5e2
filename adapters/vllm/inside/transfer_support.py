"""What a weight-transfer engine does around the receive: progress and wire-wait counting,
handing freed host memory back (``malloc_trim``), and CUDA memory figures."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass
class Progress:
    tensors: int = 0
    waiting_s: float = 0.0  # time spent waiting for the next tensor (the wire)
    trim: Callable[[], Any] | None = None
    trim_every: int = 0  # bytes loaded between two trims
    untrimmed: int = 0

    def loaded(self, tensor: Any) -> None:
        """The consumer is done with ``tensor``: trim every ``trim_every`` bytes."""
        if self.trim is None or not self.trim_every:
            return
        self.untrimmed += tensor.numel() * tensor.element_size()
        if self.untrimmed >= self.trim_every:
            self.untrimmed = 0
            self.trim()


def host_trimmer(device: Any) -> Callable[[], Any] | None:
    """glibc's ``malloc_trim`` on the CPU, else None. vLLM's CPU reload materializes each layer
    afresh and repacks its kernels; the freed memory stayed in malloc's arenas (measured:
    +263-348 MiB of RSS after each reload of a 368 MiB model, none of it live) until trimmed."""
    if getattr(device, "type", "cpu") != "cpu":
        return None
    return _malloc_trim()


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[], Any] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return lambda: trim(0)


def counting(stream: Iterator[tuple[str, Any]], progress: Progress,
              kept: list | None) -> Iterator[tuple[str, Any]]:
    """Pass the stream on, counting its items and the time spent waiting for each; keep them
    only where a list is given (the rollback copy)."""
    while True:
        asked = time.perf_counter()
        item = next(stream, None)
        progress.waiting_s += time.perf_counter() - asked
        if item is None:
            return
        progress.tensors += 1
        if kept is not None:
            kept.append(item)
        yield item
        progress.loaded(item[1])
        item = None  # hold no tensor while the next one is received


def cuda_memory_start(device: Any) -> int:
    if getattr(device, "type", "cpu") != "cuda":
        return -1
    import torch

    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def cuda_memory_end(device: Any, before: int) -> tuple[int, int, int]:
    """(allocated before, at the peak since, after) on a CUDA device; -1 each elsewhere."""
    if before < 0:
        return -1, -1, -1
    import torch

    torch.cuda.synchronize(device)
    return before, torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)


def synchronize(device: Any) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)
