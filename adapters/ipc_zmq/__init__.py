"""NeMo-RL's colocated weight stream over ZeroMQ (pyzmq), the worker's end: core/ipc_stream.py
states the protocol; this adapter reads its messages and opens nothing (the engine does)."""

from rollout_fleet.adapters.ipc_zmq.messages import SHM_HANDLE_KIND, decode_message
from rollout_fleet.adapters.ipc_zmq.stream import ZmqWeightStream, stream_address, visible_gpu_uuid

__all__ = ["SHM_HANDLE_KIND", "ZmqWeightStream", "decode_message", "stream_address",
           "visible_gpu_uuid"]
