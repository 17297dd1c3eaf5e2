"""The worker's end of NeMo-RL's colocated weight stream: a ZeroMQ REP socket connected to the
address the trainer rank binds, answering each message once the engine is done with it.

The address is NeMo-RL's on a GPU: ``ipc:///tmp/<the GPU's UUID>.sock``, which the trainer rank
on that GPU binds (both sides name the device they share). On the CPU, where several workers
share one host, it is the worker's own (``ipc://<temp>/rollout-fleet-<run>-<worker>.sock``),
which the worker's ``ipc_zmq_address`` control answers, for the trainer to bind.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from typing import Any

from rollout_fleet.adapters.ipc_zmq.messages import decode_message
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.ipc_stream import StreamGroup, WeightStream

ANSWER = b"ack"  # NeMo-RL's IPCProtocol.ACK, as its receiver sends it


def stream_address(run_dir: str, worker_id: str, gpu_uuid: str | None = None) -> str:
    """Where the worker connects: NeMo-RL's address on a GPU (``gpu_uuid`` as NVML spells
    it, ``GPU-...``), else one of this worker's own, short enough for a Unix socket path."""
    if gpu_uuid is not None:
        return f"ipc:///tmp/{gpu_uuid}.sock"
    run = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return f"ipc://{tempfile.gettempdir()}/rollout-fleet-{run}-{worker_id}.sock"


class ZmqWeightStream(WeightStream):
    """One stream, from ``async with`` to its end; ``timeout_s`` bounds each wait for the
    trainer's next message (NeMo-RL's sockets wait 120 s)."""

    def __init__(self, address: str, *, timeout_s: float, device_uuid: str | None = None) -> None:
        self.address, self._timeout_s, self._device_uuid = address, timeout_s, device_uuid
        self._context: Any = None
        self._socket: Any = None
        self._slots: dict[Any, int] = {}
        self._unanswered = False  # a REP socket answers each message once, and only then

    async def __aenter__(self) -> "ZmqWeightStream":
        import zmq.asyncio
        from zmq.constants import LINGER, REP

        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(REP)
        self._socket.setsockopt(LINGER, 0)
        self._socket.connect(self.address)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self._socket.close(linger=0)
        self._context.term()

    async def next_group(self) -> StreamGroup | None:
        try:
            data = await asyncio.wait_for(self._socket.recv(), self._timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise RefitError(f"no message from the trainer at {self.address} within"
                             f" {self._timeout_s:g} s") from None
        self._unanswered = True
        return decode_message(data, self._slot, self._device_uuid)

    async def answer(self) -> None:
        if self._unanswered:
            await asyncio.wait_for(self._socket.send(ANSWER), self._timeout_s)
            self._unanswered = False

    def _slot(self, identity: Any, _nbytes: int) -> int:
        """Each distinct buffer of the stream its own number (the engine maps each once)."""
        return self._slots.setdefault(identity, len(self._slots))


def visible_gpu_uuid() -> str:
    """The UUID (``GPU-...``, as NVML spells it, and NeMo-RL's address) of the first GPU this
    process may use: ``CUDA_VISIBLE_DEVICES`` names it by UUID or by index."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    if visible.startswith("GPU-"):
        return visible
    try:
        import pynvml  # type: ignore[import-not-found]  # optional: vLLM ships its own copy
    except ImportError:  # vLLM ships its own copy, and a GPU worker has vLLM
        from vllm.third_party import pynvml

    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(int(visible)))
    finally:
        pynvml.nvmlShutdown()
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
