"""The in-memory engine passes the engine port's and the weight-loading port's contract suites."""

import random

import pytest

from rollout_fleet.adapters.memory import MemoryCollective, MemoryWeightSender
from rollout_fleet.adapters.memory.engine import MemoryEngine, TinyBigramModel, decode
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin
from rollout_fleet.ports.contracts.colocated import ColocatedContract
from rollout_fleet.ports.contracts.engine import EngineContract, EngineUnderTest
from rollout_fleet.ports.contracts.openai_extras import OpenAIExtrasContract
from rollout_fleet.ports.contracts.group import GroupContract
from rollout_fleet.ports.contracts.refit_target import RefitTargetContract, RefitTrainer
from tests.support.memory_group import SwappableGroup

PROMPTS = [[3, 4, 5], [10, 11], [20, 21, 22, 23], [7]]


GROUP = SwappableGroup()
SPEC = CollectiveSenderSpec(buffer_bytes=1024, num_buffers=2)


@pytest.fixture(scope="class")
def engine_under_test():
    harness = EngineUnderTest.start(
        lambda: MemoryEngine(seed=0, context_length=128, join_receiver=GROUP.join_receiver),
        decode=decode, prompts=PROMPTS)
    yield harness
    harness.close()


@pytest.fixture
def refit_trainer():
    def open_group(ranks):
        GROUP.collective = MemoryCollective()  # a fresh group, as a trainer forming a new one
        return GroupJoin(host="127.0.0.1", port=1, world_size=1 + ranks, train_world_size=1,
                         first_rank=1, ranks_per_worker=ranks, sender_spec=SPEC, timeout_s=1.0,
                         backend="gloo")

    def send(info, tensors):
        MemoryWeightSender(GROUP.collective, SPEC).send(info, tensors.items())

    def send_then_die(info, tensors):
        pass  # the trainer is gone before its first byte: the receivers time out

    return RefitTrainer(open=open_group, send=send, send_then_die=send_then_die, close=lambda: None)


@pytest.fixture
def weight_sets():
    return TinyBigramModel.from_seed(0).state_dict(), TinyBigramModel.from_seed(1).state_dict()


@pytest.fixture(scope="class")
def colocated_trainer():
    from tests.support.colocated_trainer import TrainerProcess

    # 800-byte buffers: each 48 x 8 float32 matrix (1,536 bytes) closes a bucket of its own.
    trainer = TrainerProcess(buffer_bytes=800, num_buffers=2)
    yield trainer.contract(buckets_per_refit=2)
    trainer.close()


class TestMemoryEngine(EngineContract, RefitTargetContract, OpenAIExtrasContract, ColocatedContract,
                       GroupContract):
    pass


def test_sampling_without_seed_varies():
    import asyncio
    from rollout_fleet.core.rollout import SamplingSpec

    engine = MemoryEngine(seed=0)
    random.seed(0)
    outs = {asyncio.run(engine.serve_rollout([3], request_id=f"r{i}", max_new_tokens=12,
                                             sampling=SamplingSpec(greedy=False))).token_ids
            for i in range(5)}
    assert len(outs) > 1
