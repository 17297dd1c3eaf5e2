"""NeMo-RL's colocated weight stream, its pure parts: where each tensor lies in a group (512-byte
aligned offsets, the bytes used as NeMo-RL counts them), what a group may not do, and the
messages as NeMo-RL's sender pickles them (its final message, a CUDA IPC handle as torch's
``reduce_tensor`` gives it), with every other global a pickle could name refused."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from rollout_fleet.adapters.ipc_zmq import decode_message
from rollout_fleet.core.colocated_refit import (CUDA_TRANSPORT, SEGMENT_PREFIX, SHM_TRANSPORT,
                                               BufferHandle)
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.ipc_stream import StreamedRefit, StreamGroup
from rollout_fleet.core.refit import RefitInfo, TensorMeta
from support.nemo_rl_ipc_sender import complete_message

INFO = RefitInfo((TensorMeta("a", (3,), "float32"), TensorMeta("b", (200,), "bfloat16"),
                  TensorMeta("c", (2, 2), "float32")))
SEGMENT = f"{SEGMENT_PREFIX}1.2-0-abc"


def group(names, used, nbytes=4096):
    return StreamGroup(BufferHandle(SHM_TRANSPORT, 0, nbytes, name=SEGMENT), tuple(names), used)


def test_offsets_are_512_byte_aligned_and_the_bytes_used_count_the_last_slot():
    refit = StreamedRefit(INFO)
    bucket = refit.bucket(group(["b", "a"], 1024))  # 400 bytes -> 512, 12 bytes -> 512
    assert [(e.meta.name, e.offset) for e in bucket.entries] == [("b", 0), ("a", 512)]
    assert refit.missing() == ["c"]
    assert [e.offset for e in refit.bucket(group(["c"], 512)).entries] == [0]
    assert refit.missing() == []


@pytest.mark.parametrize("names, used, nbytes, field", [
    (["a", "zz"], 1024, 4096, "group 0 tensor"),  # not in the refit info
    (["a", "a"], 1024, 4096, "group 0 tensor"),  # twice
    (["a"], 12, 4096, "group 0 used_bytes"),  # unaligned: the trainer's dtype or shape differs
    (["a", "b"], 1024, 600, "group 0 buffer"),  # the buffer cannot hold what it says
])
def test_a_group_that_does_not_match_the_refit_info_is_refused_by_name(names, used, nbytes, field):
    with pytest.raises(InvalidValue) as refused:
        StreamedRefit(INFO).bucket(group(names, used, nbytes))
    assert refused.value.field == field


def test_nemo_rls_final_message_and_a_shared_memory_group_decode():
    slots = {}

    def slot_of(key, nbytes):
        return slots.setdefault(key, len(slots))

    assert decode_message(complete_message(), slot_of) is None
    decoded = decode_message(pickle.dumps((("shm", SEGMENT, 4096), ["a", "b"], 1024)), slot_of)
    assert decoded == StreamGroup(BufferHandle(SHM_TRANSPORT, 0, 4096, name=SEGMENT),
                                  ("a", "b"), 1024)


def test_a_cuda_ipc_handle_as_torch_reduces_it_becomes_the_engines_handle_on_its_gpu():
    # rebuild_cuda_tensor's arguments, as reduce_tensor gives them for a flat uint8 buffer
    args = (torch.Tensor, torch.Size([8192]), (1,), 0, torch.UntypedStorage, torch.uint8, 3,
            b"h" * 64, 16384, 4096, False, b"r" * 16, 8, b"e" * 64, True)
    slots = {}

    def slot_of(key, nbytes):
        return slots.setdefault(key, len(slots))

    handle = decode_message(pickle.dumps(((args,), ["a"], 512)), slot_of, "uuid-1").handle
    assert handle.transport == CUDA_TRANSPORT and handle.nbytes == 8192 and handle.slot == 0
    assert handle.cuda["device_uuid"] == "uuid-1"  # the engine's own GPU, not the index sent
    assert (handle.cuda["storage_size_bytes"], handle.cuda["storage_offset_bytes"]) == (16384, 4096)
    again = decode_message(pickle.dumps(((args,), ["b"], 512)), slot_of, "uuid-1").handle
    assert again.slot == 0  # the same buffer keeps its number (the engine maps it once)


def test_a_pickle_naming_any_other_global_is_refused_before_it_runs():
    class Runs:
        def __reduce__(self):
            return (os.getpid, ())

    with pytest.raises(InvalidValue) as refused:
        decode_message(pickle.dumps((Runs(), ["a"], 512)), lambda key, n: 0)
    assert refused.value.value.endswith("getpid")
