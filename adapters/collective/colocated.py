"""Buffers of the colocated refit, both ends: the trainer's pool (allocated once, reused every
bucket and every refit) and the engine's opening of a handle to one of them.

CPU: each buffer is a named shared-memory segment (``adapters.shared.segments``) viewed as a
uint8 tensor with ``torch.frombuffer``; the engine maps the same pages, so nothing is copied
between the processes. GPU: each buffer is a plain CUDA allocation whose storage is shared by
CUDA IPC (torch's ``_share_cuda_`` on the trainer, ``rebuild_cuda_tensor`` on the engine); the
handle's bytes travel base64-encoded in the control's JSON, never pickled, and name the
trainer's GPU by UUID so an engine on another GPU refuses it instead of reading across devices.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import torch
from rollout_fleet.adapters.collective.packing import torch_dtype
from rollout_fleet.adapters.shared.segments import Segment, new_segment_name, remove_orphans
from rollout_fleet.core.colocated_refit import (
    CUDA_TRANSPORT,
    SHM_TRANSPORT,
    BufferHandle,
)
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import Bucket


class BufferPool:
    """``num_buffers`` buffers of ``slot_bytes`` on ``device``: ``buffer(slot)`` to pack into,
    ``handle(slot)`` for the engine."""

    def __init__(self, slot_bytes: int, num_buffers: int, device: torch.device) -> None:
        self.slot_bytes, self.num_buffers, self.device = slot_bytes, num_buffers, device
        self.transport = CUDA_TRANSPORT if device.type == "cuda" else SHM_TRANSPORT
        if device.type not in ("cpu", "cuda"):
            raise InvalidValue("device", str(device), "colocated refits run on cpu or cuda")
        self._segments: list[Segment] = []
        self._buffers: list[torch.Tensor] = []
        self._handles: list[BufferHandle] = []
        if self.transport == SHM_TRANSPORT:
            remove_orphans()  # a trainer killed before its close left its segments behind
        try:
            for slot in range(num_buffers):
                self._buffers.append(self._allocate(slot))
                self._handles.append(self._share(slot))
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_buffers

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def handle(self, slot: int) -> BufferHandle:
        return self._handles[slot]

    def close(self) -> None:
        """Free the buffers (and unlink the segments): only once no engine reads them."""
        self._buffers, self._handles = [], []
        segments, self._segments = self._segments, []
        for segment in segments:
            segment.close()

    def release_to_views(self) -> None:
        """Let go of the buffers without freeing them: tensors that view them (a trainer's
        parameters held in place) keep their memory until they go. Segments lose their names
        now, so nothing is left in /dev/shm."""
        self._buffers, self._handles = [], []
        segments, self._segments = self._segments, []
        for segment in segments:
            segment.unlink()

    def _allocate(self, slot: int) -> torch.Tensor:
        if self.transport == CUDA_TRANSPORT:
            return torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        segment = Segment.create(new_segment_name(slot), self.slot_bytes)
        self._segments.append(segment)
        block = torch.frombuffer(segment.view, dtype=torch.uint8)
        block[::4096].zero_()  # fault the pages in now, once, not while packing
        return block

    def _share(self, slot: int) -> BufferHandle:
        if self.transport == SHM_TRANSPORT:
            return BufferHandle(SHM_TRANSPORT, slot, self.slot_bytes, name=self._segments[slot].name)
        return BufferHandle(CUDA_TRANSPORT, slot, self.slot_bytes, cuda=_cuda_share(self._buffers[slot]))

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OpenedBuffer:
    """One trainer buffer as the engine sees it: typed views of a bucket's tensors, then
    ``close`` (which fails if a view is still held: the trainer is about to reuse it)."""

    def __init__(self, block: torch.Tensor, segment: Segment | None) -> None:
        self.block, self._segment = block, segment
        self.nbytes = block.numel()
        self._idle = _use_count(block)  # the storage's references with no view handed out

    def tensors(self, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` per entry, each a view of the buffer's storage with no view base
        (``set_``), so ``keep`` can move one off the buffer entirely."""
        storage, start = self.block.untyped_storage(), self.block.storage_offset()
        for entry in bucket.entries:
            meta = entry.meta
            dtype = torch_dtype(meta.dtype)
            tensor = torch.empty((0,), dtype=dtype, device=self.block.device)
            if meta.nbytes:
                size = torch.empty((), dtype=dtype).element_size()
                tensor.set_(storage, (start + entry.offset) // size, meta.shape)
            else:
                tensor = tensor.reshape(meta.shape)
            yield meta.name, tensor

    @staticmethod
    def keep(tensor: torch.Tensor) -> int:
        """A tensor the loader still holds after its bucket: its own copy from now on (the
        loader's reference sees it); returns the bytes copied."""
        tensor.set_(tensor.clone())
        return tensor.numel() * tensor.element_size()

    def views_held(self) -> int:
        """Tensors other than ``block`` that still view the buffer."""
        if self.block is None:
            return 0
        return _use_count(self.block) - self._idle

    def close(self) -> None:
        """Unmap; refused (the mapping kept, so no view dangles) while a view is held."""
        held = self.views_held()
        if held:
            where = self._segment.name if self._segment is not None else "the CUDA IPC buffer"
            raise RefitError(f"{held} view(s) into {where} still held after its bucket was"
                             " loaded: the trainer would overwrite weights not yet copied")
        self.block = None
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()


def open_buffer(handle: BufferHandle, device: Any) -> OpenedBuffer:
    """The engine's end: map the trainer's buffer ``handle`` on ``device`` (the engine's)."""
    device = torch.device(device)
    if handle.transport == SHM_TRANSPORT:
        if device.type != "cpu":
            raise RefitError(f"a shared-memory handle for an engine on {device}: the trainer"
                             " must share GPU buffers (cuda handles)")
        if handle.name is None:
            raise RefitError(f"a shared-memory handle without a segment name (slot {handle.slot})")
        segment = Segment.open(handle.name, handle.nbytes)
        return OpenedBuffer(torch.frombuffer(segment.view, dtype=torch.uint8)[:handle.nbytes], segment)
    if device.type != "cuda":
        raise RefitError(f"a CUDA IPC handle for an engine on {device}")
    return OpenedBuffer(_cuda_open(handle, device), None)


def _use_count(block: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(block.untyped_storage()._cdata)


def _cuda_share(buffer: torch.Tensor) -> dict[str, Any]:
    storage = buffer.untyped_storage()
    (_device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return {"device_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
            "storage_handle": _text(handle), "storage_size_bytes": int(size),
            "storage_offset_bytes": int(offset), "ref_counter_handle": _text(ref_handle),
            "ref_counter_offset": int(ref_offset), "event_handle": _text(event_handle),
            "event_sync_required": bool(event_sync)}


def indexed_device(device: torch.device) -> torch.device:
    """``cuda`` as the device it means now (``cuda:<current>``), so it equals a tensor's."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _cuda_open(handle: BufferHandle, device: torch.device) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    fields = handle.cuda
    if fields is None:
        raise RefitError(f"a CUDA IPC handle without its fields (slot {handle.slot})")
    index = indexed_device(device).index
    mine = str(torch.cuda.get_device_properties(index).uuid)
    if fields["device_uuid"] != mine:
        raise RefitError(f"the trainer's buffer is on GPU {fields['device_uuid']}, this engine"
                         f" runs on GPU {mine}: a colocated refit needs both on one device")
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, (handle.nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, index,
            _bytes(fields["storage_handle"]), fields["storage_size_bytes"],
            fields["storage_offset_bytes"], False, _bytes(fields["ref_counter_handle"]),
            fields["ref_counter_offset"], _bytes(fields["event_handle"]),
            fields["event_sync_required"])
    except RuntimeError as error:
        raise RefitError(f"cannot open the trainer's CUDA IPC handle (slot {handle.slot}):"
                         f" {error}") from None


def _text(raw: Any) -> str | None:
    return None if raw is None else base64.b64encode(bytes(raw)).decode("ascii")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
