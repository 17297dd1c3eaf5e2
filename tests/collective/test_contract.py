"""The weight sender / receiver contract suite, run against real gloo groups (ranks in threads)."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout_fleet.adapters.collective import TorchWeightReceiver, TorchWeightSender, init_group
from rollout_fleet.adapters.collective.packing import as_bytes
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.ports.contracts.collective import CollectiveContract, CollectiveUnderTest
from tests.collective import peers
from tests.collective.harness import JOIN_TIMEOUT_S, free_port

pytestmark = pytest.mark.collective


def make_group(sender_spec, receiver_specs):
    """Form one group of 1 + len(receiver_specs) ranks, each joining from its own thread."""
    port, world_size = free_port(), 1 + len(receiver_specs)
    groups: list = [None] * world_size

    def join(rank):
        groups[rank] = init_group("127.0.0.1", port, rank, world_size, "gloo", JOIN_TIMEOUT_S)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(groups), "a rank did not join"
    return (TorchWeightSender(groups[0], sender_spec),
            [TorchWeightReceiver(g, s) for g, s in zip(groups[1:], receiver_specs)])


def state_dict():
    tensors = peers.make_state_dict(11)
    return refit_info_of(tensors), tensors


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


@pytest.fixture
def collective_under_test():
    return CollectiveUnderTest(make_group=make_group, state_dict=state_dict, same=same)


class TestTorchCollective(CollectiveContract):
    pass
