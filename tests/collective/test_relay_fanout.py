"""The tree fan-out over a real gloo group whose ranks are threads of this process: every worker
receives the trainer's bytes bit for bit, over several refits and geometries, while no rank
sends more than the refit's bytes and one piece; a group whose ranks disagree on the fan-out refuses alike."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from rollout_fleet.adapters.collective import TorchWeightSender, init_group, join_receiver, wire
from rollout_fleet.adapters.collective.group import CollectiveGroup
from rollout_fleet.adapters.collective.packing import as_bytes
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitFanout
from tests.collective import peers
from tests.collective.harness import JOIN_TIMEOUT_S, free_port
from tests.collective.test_in_process import in_threads

pytestmark = pytest.mark.collective
WORKERS = 5


def open_group(specs: list[CollectiveSenderSpec]):
    """A trainer (rank 0) and one receiver per worker spec, all threads of one gloo group."""
    port, world = free_port(), 1 + len(specs)
    joined = in_threads(
        lambda: init_group("127.0.0.1", port, 0, world, "gloo", JOIN_TIMEOUT_S),
        *[lambda rank=rank, spec=spec: join_receiver(GroupJoin(
            host="127.0.0.1", port=port, world_size=world, train_world_size=1, first_rank=rank,
            ranks_per_worker=1, sender_spec=spec, timeout_s=JOIN_TIMEOUT_S, backend="gloo"))
          for rank, spec in enumerate(specs, start=1)])
    assert not any(isinstance(member, BaseException) for member in joined), joined
    return joined[0], joined[1:]


@pytest.fixture
def bytes_sent(monkeypatch):
    """Bytes of the refit each data rank hands to point-to-point sends (the relay's only way
    out; the header tables, int64, are left out)."""
    sent: collections.Counter = collections.Counter()
    lock = threading.Lock()
    send = CollectiveGroup.send

    def counted(group, tensor, to_data_rank):
        if tensor.dtype == torch.uint8:
            with lock:
                sent[group.data_rank] += tensor.numel()
        return send(group, tensor, to_data_rank)

    monkeypatch.setattr(CollectiveGroup, "send", counted)
    return sent


@pytest.mark.parametrize("buffer_bytes,num_buffers,chunk_bytes", [
    (4096, 2, 1000),  # many buckets, each of several pieces, two buffers in flight
    (1000, 1, 1 << 22),  # one buffer: each bucket posted once the previous one is consumed
    (1 << 20, 3, 1 << 22),  # the whole refit in one bucket, one piece
])
def test_every_worker_receives_the_trainer_bytes_bit_exact(monkeypatch, bytes_sent, buffer_bytes,
                                                           num_buffers, chunk_bytes):
    monkeypatch.setattr(wire, "GLOO_WIRE_CHUNK_BYTES", chunk_bytes)  # every rank lives here
    wire.wire_pieces.cache_clear()
    spec = CollectiveSenderSpec(buffer_bytes=buffer_bytes, num_buffers=num_buffers,
                                fanout=RefitFanout.TREE)
    group, receivers = open_group([spec] * WORKERS)
    sender = TorchWeightSender(group, spec)
    try:
        for seed in (11, 12):  # a second refit over the same group and blocks
            tensors = peers.make_state_dict(seed)
            info = refit_info_of(tensors)
            bytes_sent.clear()
            outcomes = in_threads(lambda: sender.send(info, tensors),
                                  *[lambda r=r: [(n, as_bytes(t).clone()) for n, t in r.receive(info)]
                                    for r in receivers])
            assert outcomes[0] is None, outcomes[0]
            for worker, received in enumerate(outcomes[1:], start=1):
                assert not isinstance(received, BaseException), (worker, received)
                assert [name for name, _ in received] == list(tensors)
                for name, data in received:
                    assert torch.equal(data, as_bytes(tensors[name])), (worker, name)
            # The trainer sends the refit once, and no worker more than that and one piece.
            pieces = [piece.stop - piece.start for bucket in wire.bucket_plan(
                info, buffer_bytes) for piece in wire.wire_pieces(bucket, "gloo")]
            on_wire = sum(pieces)
            assert bytes_sent[0] == on_wire
            assert max(bytes_sent[w] for w in range(1, WORKERS + 1)) <= on_wire + max(pieces)
            assert sum(bytes_sent.values()) == WORKERS * on_wire
    finally:
        wire.wire_pieces.cache_clear()
        sender.close()
        for receiver in receivers:
            receiver.close()


def test_a_worker_on_another_fanout_is_refused_on_every_rank():
    tree = CollectiveSenderSpec(buffer_bytes=4096, fanout=RefitFanout.TREE)
    group, receivers = open_group([tree, CollectiveSenderSpec(buffer_bytes=4096), tree])
    sender = TorchWeightSender(group, tree)
    tensors = peers.make_state_dict(3)
    info = refit_info_of(tensors)
    try:
        outcomes = in_threads(lambda: sender.send(info, tensors),
                              *[lambda r=r: list(r.receive(info)) for r in receivers])
        for outcome in outcomes:
            assert isinstance(outcome, RefitError), outcome
            assert "rank 2 has a different fanout" in str(outcome)
    finally:
        sender.close()
        for receiver in receivers:
            receiver.close()
