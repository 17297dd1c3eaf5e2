"""A trainer rank that streams its weights as NeMo-RL's colocated sender does, restated.

Written from reading NeMo-RL's sender (``nemo_rl/models/policy/utils.py``,
``stream_weights_via_ipc_zmq_impl``) and its receiver and synchroniser
(``models/generation/vllm/vllm_backend.py``, ``weight_sync/ipc_weight_synchronizer.py``);
none of its code is copied. What it reproduces:

- a ZeroMQ REQ socket the trainer binds (NeMo-RL: ``ipc:///tmp/<GPU UUID>.sock``); the engine
  side connects and answers every message;
- the buffer budget halved into two buffers used in turn (ping-pong), each rounded up to 512
  bytes; tensors packed as flat bytes at 512-byte aligned offsets, in the order given;
- a message per full buffer, pickled by pyzmq's ``send_pyobj``: ``(handle, names,
  used_bytes)``, ``used_bytes`` counting the last tensor's aligned slot; the answer to a
  buffer is awaited only before the next message, so one buffer fills while the other loads;
- a tensor larger than a buffer goes alone in a buffer of its own size, after the group in
  progress, and its answer is awaited at once (that buffer is freed next);
- the final message, NeMo-RL's ``IPCProtocol.COMPLETE`` (pickled under NeMo-RL's module
  name), sent once the last buffer is answered, and its answer awaited.

The handle: on a GPU, torch's ``reduce_tensor`` of the buffer less its rebuild function (as
NeMo-RL's); on the CPU, where NeMo-RL has no sender, ``("shm", segment name, bytes)`` for a
named shared-memory segment: the same stream with another handle. NeMo-RL is not installable
here, so its enum is pickled through a look-alike standing under its module name.
"""

from __future__ import annotations

import enum
import os
import pickle
import threading
from collections.abc import Iterable

import torch
import zmq

from rollout_fleet.adapters.shared.segments import Segment, new_segment_name
from support.nemo_rl_sender import pickled_as_if_from

ALIGNMENT = 512
NEMO_RL_MODULE = "nemo_rl.models.policy.utils"
SHM_KIND = "shm"


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def complete_message() -> bytes:
    """NeMo-RL's ``IPCProtocol.COMPLETE`` as ``send_pyobj`` pickles it."""
    class IPCProtocol(enum.Enum):
        COMPLETE = "complete"
        ACK = "ack"

    return pickled_as_if_from(NEMO_RL_MODULE, IPCProtocol, lambda: IPCProtocol.COMPLETE,
                              pickle.DEFAULT_PROTOCOL)


class StagingBuffer:
    """One buffer the engine reads: shared memory on the CPU, a CUDA allocation on a GPU."""

    def __init__(self, nbytes: int, device: torch.device, slot: int) -> None:
        self.nbytes, self.segment = nbytes, None
        if device.type == "cuda":
            self.block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            self.segment = Segment.create(new_segment_name(slot), nbytes)
            self.block = torch.frombuffer(self.segment.view, dtype=torch.uint8)

    def handle(self) -> tuple:
        if self.segment is None:
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.current_stream().synchronize()
            return reduce_tensor(self.block.detach())[1:]
        return (SHM_KIND, self.segment.name, self.nbytes)

    def pack(self, tensor: torch.Tensor, used: int) -> int:
        nbytes = tensor.numel() * tensor.element_size()
        self.block[used:used + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
        return used + aligned(nbytes)

    def free(self) -> None:
        self.block = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class IpcStreamSender:
    """``stream(named_tensors)`` over ``socket`` (a bound REQ socket), ``buffer_bytes`` split
    in two. Counts what it sent (``groups``, ``oversized``) for the tests."""

    def __init__(self, socket, buffer_bytes: int, device: torch.device | str = "cpu") -> None:
        self.socket, self.device = socket, torch.device(device)
        self.half = buffer_bytes // 2
        self.groups = self.oversized = 0
        self._awaiting = False
        self._slots = 0

    def stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pair = [self._buffer(aligned(self.half)), self._buffer(aligned(self.half))]
        current, used, names = 0, 0, []
        try:
            for name, tensor in named_tensors:
                size = aligned(tensor.numel() * tensor.element_size())
                if size > self.half:
                    if names:
                        self._send(pair[current], names, used)
                        current, used, names = 1 - current, 0, []
                    self._send_alone(name, tensor, size)
                    continue
                if used + size > self.half:
                    self._send(pair[current], names, used)
                    current, used, names = 1 - current, 0, []
                used = pair[current].pack(tensor, used)
                names.append(name)
            if names:
                self._send(pair[current], names, used)
            self._await_answer()
            self.socket.send(complete_message())
            self.socket.recv()
        finally:
            for buffer in pair:
                buffer.free()

    def _send(self, buffer: StagingBuffer, names: list[str], used: int) -> None:
        handle = buffer.handle()
        self._await_answer()
        self.socket.send_pyobj((handle, list(names), used))
        self._awaiting = True
        self.groups += 1

    def _send_alone(self, name: str, tensor: torch.Tensor, size: int) -> None:
        alone = self._buffer(size)
        try:
            used = alone.pack(tensor, 0)
            self._send(alone, [name], used)
            self._await_answer()  # this buffer is freed next: its answer first
            self.oversized += 1
        finally:
            alone.free()

    def _await_answer(self) -> None:
        if self._awaiting:
            self.socket.recv()
            self._awaiting = False

    def _buffer(self, nbytes: int) -> StagingBuffer:
        self._slots += 1
        return StagingBuffer(nbytes, self.device, self._slots)


class TrainerRank:
    """The sender on a thread, bound at the worker's address as a trainer rank binds it, each
    wait bounded by ``timeout_s`` (as NeMo-RL's sockets are)."""

    def __init__(self, address: str, named_tensors, buffer_bytes: int, *, timeout_s: float,
                 device: torch.device | str = "cpu") -> None:
        self.address, self.timeout_s, self.failures = address, timeout_s, []
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.socket.bind(address)
        self.sender = IpcStreamSender(self.socket, buffer_bytes, device)
        self.thread = threading.Thread(target=self._stream, args=(named_tensors,))
        self.thread.start()

    def _stream(self, named_tensors) -> None:
        try:
            self.sender.stream(named_tensors)
        except Exception as error:  # noqa: BLE001 - reported by join
            self.failures.append(error)

    def join(self) -> None:
        """Wait for the stream's end; it ended without error (every message answered)."""
        self.thread.join(self.timeout_s)
        self.socket.close(linger=0)
        self.context.term()
        os.unlink(self.address.removeprefix("ipc://"))  # the binder's file: libzmq leaves it
        assert self.failures == [] and not self.thread.is_alive()
