"""Real gloo groups whose ranks are threads of this process: validation, reuse, abandonment."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from rollout_fleet.adapters.collective import (
    TorchWeightReceiver, TorchWeightSender, init_group, join_receiver,
)
from rollout_fleet.adapters.collective.packing import BlockPool, as_bytes, pack_bucket, unpack_bucket
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, plan_buckets
from tests.collective import peers
from tests.collective.harness import JOIN_TIMEOUT_S, free_port

pytestmark = pytest.mark.collective
SPEC = CollectiveSenderSpec(buffer_bytes=2048, num_buffers=2)


def in_threads(*calls):
    results: list = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # reported to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def open_pair(timeout_s: float = JOIN_TIMEOUT_S):
    """A sender (rank 0) and a receiver (rank 1) of one fresh gloo group, and how to close it."""
    port = free_port()
    sender_group, receiver = in_threads(
        lambda: init_group("127.0.0.1", port, 0, 2, "gloo", timeout_s),
        lambda: join_receiver(GroupJoin(host="127.0.0.1", port=port, world_size=2, train_world_size=1,
                                        first_rank=1, ranks_per_worker=1, sender_spec=SPEC,
                                        timeout_s=timeout_s, backend="gloo")))

    def close():
        sender_group.close()
        receiver.close()

    return TorchWeightSender(sender_group, SPEC), receiver, close


@pytest.fixture
def pair():
    sender, receiver, close = open_pair()
    yield sender, receiver
    close()


def test_packing_round_trips_every_dtype_and_shape_bit_exact():
    tensors = peers.make_state_dict(3)
    info = refit_info_of(tensors)
    for bucket in plan_buckets(info.tensors, 512):
        block = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_bucket(block, bucket, [tensors[e.meta.name] for e in bucket.entries])
        for name, view in unpack_bucket(block, bucket):
            assert view.dtype == tensors[name].dtype and view.shape == tensors[name].shape
            assert torch.equal(as_bytes(view), as_bytes(tensors[name]))


def test_a_non_contiguous_tensor_is_packed_by_value():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    info = refit_info_of({"t": tensor})
    (bucket,) = plan_buckets(info.tensors, 1 << 10)
    block = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(block, bucket, [tensor])
    assert torch.equal(dict(unpack_bucket(block, bucket))["t"], tensor)


def test_a_bad_state_dict_is_refused_before_any_byte_and_the_group_stays_usable(pair):
    sender, receiver = pair
    tensors = peers.make_state_dict(5)
    info = refit_info_of(tensors)
    wrong = dict(tensors, **{"embed.weight": torch.zeros(2, 2)})
    with pytest.raises(InvalidValue, match="shape of 'embed.weight'"):
        sender.send(info, wrong)
    with pytest.raises(InvalidValue, match="not in the refit info"):
        sender.send(info, dict(tensors, extra=torch.zeros(1)))
    sent, received = in_threads(lambda: sender.send(info, tensors),
                                lambda: list(receiver.receive(info)))
    assert sent is None
    assert [n for n, _ in received] == list(tensors)
    assert all(torch.equal(as_bytes(t), as_bytes(tensors[n])) for n, t in received)


def test_received_tensors_stay_valid_after_later_buckets_arrive(pair):
    # Views into handed-over blocks: keeping every tensor of several refits must not alias.
    sender, receiver = pair
    kept = []
    for seed in (1, 2):
        tensors = peers.make_state_dict(seed)
        info = refit_info_of(tensors)
        _, received = in_threads(lambda: sender.send(info, tensors),
                                 lambda: list(receiver.receive(info)))
        kept.append((tensors, received))
    for tensors, received in kept:
        assert all(torch.equal(as_bytes(t), as_bytes(tensors[n])) for n, t in received)


def test_a_receiver_abandoned_mid_refit_refuses_to_be_reused():
    # The sender's broadcast of the buckets nobody takes ends at the group's timeout: a short one.
    sender, receiver, close = open_pair(timeout_s=15.0)
    tensors = peers.make_state_dict(4)
    info = refit_info_of(tensors)

    def take_two():
        stream = receiver.receive(info)
        got = [next(stream), next(stream)]
        stream.close()
        return got

    try:
        in_threads(lambda: sender.send(info, tensors), take_two)
        with pytest.raises(RefitError, match="stopped before the last bucket"):
            list(receiver.receive(info))
    finally:
        close()


def test_a_worker_adopts_the_trainer_world_size_of_rank_0():
    port = free_port()
    groups = in_threads(
        lambda: init_group("127.0.0.1", port, 0, 4, "gloo", JOIN_TIMEOUT_S, train_world_size=2),
        lambda: init_group("127.0.0.1", port, 1, 4, "gloo", JOIN_TIMEOUT_S, train_world_size=2),
        lambda: init_group("127.0.0.1", port, 2, 4, "gloo", JOIN_TIMEOUT_S),
        lambda: init_group("127.0.0.1", port, 3, 4, "gloo", JOIN_TIMEOUT_S))
    try:
        assert [g.train_world_size for g in groups] == [2, 2, 2, 2]
        assert [g.data_rank for g in groups] == [0, None, 1, 2]
        with pytest.raises(InvalidValue, match="a receiver is a worker rank"):
            TorchWeightReceiver(groups[1], SPEC)
    finally:
        for g in groups:
            g.close()


def test_a_closed_group_never_closes_a_descriptor_it_no_longer_owns():
    # The store's server owns the listening socket it is given and closes it from its own
    # thread; a second close of that number by this process would hit whatever file another
    # thread opened there meanwhile. A witness thread keeps taking the lowest free numbers.
    stop, hits = threading.Event(), []

    def witness():
        while not stop.is_set():
            fd = os.open(os.devnull, os.O_RDONLY)
            time.sleep(0.0005)
            try:
                os.fstat(fd)
                os.close(fd)
            except OSError as exc:
                hits.append(f"fd {fd}: {exc.strerror}")

    thread = threading.Thread(target=witness, daemon=True)
    thread.start()
    try:
        for _ in range(20):
            _, _, close = open_pair()
            close()
    finally:
        stop.set()
        thread.join(10)
    assert not hits, f"descriptors closed behind this process's back: {hits}"


@pytest.mark.parametrize("kwargs, field", [
    (dict(rank=3, world_size=3), "rank"),
    (dict(rank=0, world_size=1), "world_size"),
    (dict(rank=0, world_size=3, backend="mpi"), "backend"),
    (dict(rank=0, world_size=3, train_world_size=3), "train_world_size"),
    (dict(rank=0, world_size=3, timeout_s=0), "timeout_s"),
])
def test_bad_group_arguments_are_refused_naming_the_field(kwargs, field):
    args = dict(host="127.0.0.1", port=free_port(), backend="gloo", timeout_s=5.0) | kwargs
    with pytest.raises(InvalidValue) as caught:
        init_group(**args)
    assert caught.value.field == field


def test_a_receive_block_is_reused_only_once_no_tensor_views_it():
    pool = BlockPool(torch.device("cpu"), capacity=3)
    first = pool.take(1000, 4096)
    kept = first[8:16].view(torch.int64)  # a tensor handed out, still alive
    del first
    second = pool.take(1000, 4096)
    assert second.data_ptr() != kept.data_ptr() - 8  # busy: a new block
    del kept
    third = pool.take(4096, 4096)
    assert third.untyped_storage().data_ptr() in {b.untyped_storage().data_ptr()
                                                  for b, _ in pool._kept[:1]}  # the first, reused


def test_the_pool_keeps_at_most_its_capacity():
    pool = BlockPool(torch.device("cpu"), capacity=2)
    held = [pool.take(100, 100) for _ in range(5)]
    assert len(pool._kept) == 2 and len(held) == 5


@pytest.mark.parametrize("group", [0, 1, 3])
def test_the_gpu_cat_packing_gives_the_same_bytes_as_the_copy_loop(group, monkeypatch):
    # The cat path runs on GPUs only; its arithmetic (gaps, groups) is checked here on the CPU.
    from rollout_fleet.adapters.collective import packing
    monkeypatch.setattr(packing, "CAT_GROUP", group)
    tensors = peers.make_state_dict(8)
    info = refit_info_of(tensors)
    for bucket in plan_buckets(info.tensors, 4096):
        entries = [(e, tensors[e.meta.name]) for e in bucket.entries if e.meta.nbytes]
        if not entries:
            continue
        by_loop = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        by_cat = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_bucket(by_loop, bucket, [tensors[e.meta.name] for e in bucket.entries])
        packing._pack_by_cat(by_cat, entries)
        assert torch.equal(by_loop, by_cat)


def test_buckets_larger_than_a_wire_chunk_arrive_bit_exact(pair, monkeypatch):
    from rollout_fleet.adapters.collective import wire
    monkeypatch.setattr(wire, "GLOO_WIRE_CHUNK_BYTES", 1000)  # both ranks live here
    sender, receiver = pair
    tensors = peers.make_state_dict(9)
    info = refit_info_of(tensors)
    _, received = in_threads(lambda: sender.send(info, tensors),
                             lambda: list(receiver.receive(info)))
    assert [n for n, _ in received] == list(tensors)
    assert all(torch.equal(as_bytes(t), as_bytes(tensors[n])) for n, t in received)
