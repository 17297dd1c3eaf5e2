"""The vLLM engine passes the same engine, refit and colocated refit contract suites as the
in-memory engine: refits are received inside vLLM's worker, over a real gloo group from a
trainer rank 0 in a thread of this process, or out of the shared buffers of a trainer process."""

import pytest

from rollout_fleet.core.refit import CollectiveSenderSpec
from rollout_fleet.ports.contracts.colocated import ColocatedContract
from rollout_fleet.ports.contracts.engine import EngineContract
from rollout_fleet.ports.contracts.openai_extras import OpenAIExtrasContract
from rollout_fleet.ports.contracts.group import GroupContract
from rollout_fleet.ports.contracts.refit_target import RefitTargetContract
from tests.support.trainer import ThreadedTrainer

from .conftest import MODEL_SEED, OTHER_SEED


@pytest.fixture(scope="class")
def engine_under_test(vllm_engine):
    return vllm_engine


@pytest.fixture
def weight_sets(weights):
    return weights[MODEL_SEED], weights[OTHER_SEED]


@pytest.fixture
def refit_trainer():
    # Small buffers: the tiny model's refit crosses several buckets.
    trainer = ThreadedTrainer(CollectiveSenderSpec(buffer_bytes=256 << 10, num_buffers=2),
                              timeout_s=30.0)
    yield trainer.as_contract()
    trainer.close()


@pytest.fixture(scope="class")
def colocated_trainer(weights):
    from rollout_fleet.adapters.collective.transfer import refit_info_of
    from rollout_fleet.core.refit import plan_buckets
    from tests.support.colocated_trainer import TrainerProcess

    buffer_bytes = 256 << 10  # the tiny model crosses several buckets, as in the packed suite
    trainer = TrainerProcess(buffer_bytes=buffer_bytes, num_buffers=2)
    buckets = len(plan_buckets(refit_info_of(weights[MODEL_SEED]).tensors, buffer_bytes))
    yield trainer.contract(buckets_per_refit=buckets)
    trainer.close()


class TestVllmEngine(EngineContract, RefitTargetContract, OpenAIExtrasContract, ColocatedContract,
                     GroupContract):
    pass
