"""The messages of NeMo-RL's colocated weight stream, read as NeMo-RL's sender writes them.

Each is one pickle (pyzmq's ``send_pyobj``): a group is ``(handle, names, used_bytes)``, the
end is NeMo-RL's ``IPCProtocol.COMPLETE`` (an enum of ``nemo_rl.models.policy.utils``). The
handle on a GPU is what torch's ``reduce_tensor`` gives for the buffer, less its rebuild
function: a 1-tuple holding the 15 arguments of ``rebuild_cuda_tensor``. On the CPU, where
NeMo-RL has no sender, the same stream carries ``("shm", segment name, bytes)``: a named
shared-memory segment, as the project's colocated refit shares buffers there.

A pickle runs whatever globals it names, so the unpickler here resolves only the few a stream
holds (NeMo-RL's enum, torch's tensor, storage, dtype and size), each to an inert stand-in, and
refuses every other: nothing of torch or NeMo-RL is imported, and nothing else can run.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

from rollout_fleet.core.colocated_refit import CUDA_TRANSPORT, SHM_TRANSPORT, BufferHandle
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.ipc_stream import StreamGroup

SHM_HANDLE_KIND = "shm"
COMPLETE = "complete"  # NeMo-RL's IPCProtocol.COMPLETE, by its value
_NEMO_RL_ENUM = ("nemo_rl.models.policy.utils", "IPCProtocol")
_TORCH_NAMES = {"Tensor", "UntypedStorage", "TypedStorage", "uint8", "Size"}
_CUDA_ARGS = 15  # rebuild_cuda_tensor's arguments


class _Signal(str):
    """NeMo-RL's IPCProtocol member, by value."""


class _TorchName(str):
    """A torch global a handle names (a class or a dtype), by its name."""


class _StreamUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _NEMO_RL_ENUM:
            return _Signal
        if module in ("torch", "torch.storage") and name in _TORCH_NAMES:
            return tuple if name == "Size" else _TorchName(f"torch.{name}")
        raise InvalidValue("stream message", f"{module}.{name}",
                           "names a global a weight stream never holds")


def decode_message(data: bytes, slot_of: Callable[[Any, int], int],
                   device_uuid: str | None = None) -> StreamGroup | None:
    """One message: a group, or None for the final one. ``slot_of(identity, nbytes)`` numbers
    each distinct buffer; ``device_uuid``: the engine's GPU, which a CUDA handle is opened on
    (the stream's address is that GPU's, so the trainer's buffer is on it)."""
    try:
        payload = _StreamUnpickler(io.BytesIO(data)).load()
    except InvalidValue:
        raise  # a global it refused, by name
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise InvalidValue("stream message", f"{len(data)} bytes", f"not a pickle: {error}") \
            from None
    if isinstance(payload, _Signal):
        if payload != COMPLETE:
            raise InvalidValue("stream message", str(payload), f"the final message is {COMPLETE!r}")
        return None
    if not isinstance(payload, tuple) or len(payload) != 3:
        raise InvalidValue("stream message", type(payload).__name__,
                           "must be (handle, names, used_bytes) or the final message")
    handle, names, used = payload
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidValue("stream message names", names, "must be a list of tensor names")
    if isinstance(used, bool) or not isinstance(used, int) or used < 0:
        raise InvalidValue("stream message used_bytes", used, "must be an int >= 0")
    return StreamGroup(buffer_handle(handle, slot_of, device_uuid), tuple(names), used)


def buffer_handle(handle: Any, slot_of: Callable[[Any, int], int],
                  device_uuid: str | None) -> BufferHandle:
    """The stream's handle as the engine's ``BufferHandle``."""
    if isinstance(handle, tuple) and len(handle) == 3 and handle[0] == SHM_HANDLE_KIND:
        _kind, name, nbytes = handle
        return BufferHandle(SHM_TRANSPORT, slot_of(name, nbytes), nbytes, name=name)
    if isinstance(handle, tuple) and len(handle) == 1 and isinstance(handle[0], tuple) \
            and len(handle[0]) == _CUDA_ARGS:
        return _cuda_handle(handle[0], slot_of, device_uuid)
    raise InvalidValue("stream message handle", type(handle).__name__,
                       "must be a CUDA IPC handle (torch's reduce_tensor of the buffer) or"
                       f" ({SHM_HANDLE_KIND!r}, segment name, bytes)")


def _cuda_handle(args: tuple, slot_of: Callable[[Any, int], int],
                 device_uuid: str | None) -> BufferHandle:
    (_cls, size, _stride, offset, _storage_cls, dtype, _device, storage_handle, storage_bytes,
     storage_offset, _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    if dtype != "torch.uint8" or len(tuple(size)) != 1 or offset != 0:
        raise InvalidValue("stream message handle", f"{dtype} {tuple(size)} at {offset}",
                           "the buffer is a flat torch.uint8 tensor at its storage's start")
    if device_uuid is None:
        raise InvalidValue("stream message handle", "cuda", "this worker's engine is not on a GPU")
    nbytes = int(tuple(size)[0])
    fields = {"device_uuid": device_uuid, "storage_handle": _text(storage_handle),
              "storage_size_bytes": int(storage_bytes),
              "storage_offset_bytes": int(storage_offset), "ref_counter_handle": _text(ref_handle),
              "ref_counter_offset": int(ref_offset), "event_handle": _text(event_handle),
              "event_sync_required": bool(event_sync)}
    slot = slot_of((bytes(storage_handle), int(storage_offset)), nbytes)
    return BufferHandle(CUDA_TRANSPORT, slot, nbytes, cuda=fields)


def _text(raw: Any) -> str | None:
    import base64

    return None if raw is None else base64.b64encode(bytes(raw)).decode("ascii")
