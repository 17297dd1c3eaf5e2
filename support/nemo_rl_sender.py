"""A trainer rank that refits as NeMo-RL's trainer does, with gloo in NCCL's place (CPU only).

Written from reading NeMo-RL's sender (``nemo_rl/distributed/stateless_process_group.py``,
``nemo_rl/utils/packed_tensor.py``, the policy workers' ``broadcast_weights_for_collective``);
none of its code is copied. What it reproduces, byte for byte:

- the rendezvous: a TCPStore on the trainer's address (rank 0 its server); rank 0 publishes
  the 128-byte NCCL unique id raw under ``nccl_unique_id`` and, for the ``"vllm"`` peer, also
  pickled as vLLM's ctypes ``ncclUniqueId`` under ``broadcast_from/0/0`` (where vLLM's
  receiver reads it). A trainer has no vLLM installed, so the pickle is made with a look-alike
  class standing under vLLM's module name for the moment of pickling;
- the warm-up: for the ``"vllm"`` peer one all-reduce of a one-element zero tensor (what
  vLLM's communicator does first); for ``"nemo"`` a broadcast of ones from rank 0;
- the packed stream: tensors in state-dict order, each flattened to its bytes, concatenated
  with no padding; a buffer is broadcast from rank 0 once it holds more than
  ``buffer_size_bytes`` (the tensor that crosses the line travels in it), the rest at the end.
  Every trainer rank takes part in each broadcast (rank 0's bytes win).

This module never imports vLLM: a trainer process does not have it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import sys
import types
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

RAW_ID_KEY = "nccl_unique_id"
VLLM_ID_KEY = "broadcast_from/0/0"
VLLM_ID_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"
GLOO_PREFIX = "gloo-in-place-of-nccl"
TIMEOUT = timedelta(seconds=120)


def pickled_as_vllm_unique_id(raw: bytes) -> bytes:
    """``raw`` pickled as vLLM's ``ncclUniqueId`` (a ctypes struct of 128 bytes)."""
    class ncclUniqueId(ctypes.Structure):  # noqa: N801 - vLLM's class name, as pickled
        _fields_ = [("internal", ctypes.c_byte * 128)]

    return pickled_as_if_from(VLLM_ID_MODULE, ncclUniqueId,
                              lambda: ncclUniqueId.from_buffer_copy(raw))


def pickled_as_if_from(module_name: str, cls: type, value, protocol: int | None = None) -> bytes:
    """``value()`` pickled as if ``cls`` were defined in ``module_name`` (a module not installed
    here): the module and its parents stand in ``sys.modules`` only while pickling."""
    cls.__module__, cls.__qualname__ = module_name, cls.__name__
    names = module_name.split(".")
    modules = [".".join(names[:i + 1]) for i in range(len(names))]
    saved = {name: sys.modules.get(name) for name in modules}
    try:
        for name in modules:
            sys.modules[name] = types.ModuleType(name)
        setattr(sys.modules[module_name], cls.__name__, cls)
        return pickle.dumps(value(), protocol)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class GlooBroadcaster:
    """The trainer's group: NeMo-RL's store protocol, gloo carrying the bytes."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, peer: str = "vllm"):
        if peer not in ("nemo", "vllm"):
            raise ValueError(f"Unsupported NCCL peer protocol: {peer!r}.")
        self.rank = rank
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
        if rank == 0:
            self.unique_id = os.urandom(128)  # stands in for ncclGetUniqueId on the CPU
            self.store.set(RAW_ID_KEY, self.unique_id)
            if peer == "vllm":
                self.store.set(VLLM_ID_KEY, pickled_as_vllm_unique_id(self.unique_id))
        else:
            self.store.wait([RAW_ID_KEY])
            self.unique_id = self.store.get(RAW_ID_KEY)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, self.store), rank,
                                           world_size, TIMEOUT)
        if peer == "vllm":
            self.group.allreduce([torch.zeros(1)]).wait()
        else:
            self.broadcast(torch.ones(1) if rank == 0 else torch.zeros(1), 0)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()


def send_packed(group: GlooBroadcaster, tensors: Iterable[torch.Tensor],
                buffer_size_bytes: int) -> int:
    """The packed stream; returns how many buffers were broadcast."""
    pending: list[torch.Tensor] = []
    size = sent = 0
    for tensor in tensors:
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        pending.append(flat)
        size += flat.numel()
        if size > buffer_size_bytes:
            group.broadcast(torch.cat(pending), src=0)
            pending, size, sent = [], 0, sent + 1
    if pending:
        group.broadcast(torch.cat(pending), src=0)
        sent += 1
    return sent


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def trainer_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """A tied-embedding model's state dict as a trainer holds it, in bfloat16 (NeMo-RL sends in
    the policy's dtype): ``lm_head.weight`` is there although the checkpoint has none."""
    from rollout_fleet.adapters.tiny_model import TinyModelSpec, tiny_state_dict

    weights = tiny_state_dict(seed, TinyModelSpec(tie_word_embeddings=True))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}


def trainer_rank(host: str, port: int, rank: int, world_size: int, seed: int,
                 buffer_size_bytes: int) -> dict:
    """One trainer rank of a refit: join, warm up, send the state dict once."""
    try:
        group = GlooBroadcaster(host, port, rank, world_size, peer="vllm")
        weights = trainer_state_dict(seed)
        buffers = send_packed(group, weights.values(), buffer_size_bytes)
        return {"ok": True, "rank": rank, "unique_id": group.unique_id.hex(), "buffers": buffers,
                "digests": {name: digest(t) for name, t in weights.items()}}
    except Exception as error:  # reported to the test, which asserts on it
        return {"ok": False, "rank": rank, "error": f"{type(error).__name__}: {error}"}
