"""The in-memory engine passes the engine port's and the weight-loading port's contract suites."""

import random

import pytest

from rollout_fleet.adapters.memory.engine import MemoryEngine, TinyBigramModel, decode
from rollout_fleet.ports.contracts.engine import EngineContract, EngineUnderTest, WeightLoaderContract

PROMPTS = [[3, 4, 5], [10, 11], [20, 21, 22, 23], [7]]


@pytest.fixture(scope="class")
def engine_under_test():
    harness = EngineUnderTest.start(lambda: MemoryEngine(seed=0, context_length=128),
                                    decode=decode, prompts=PROMPTS)
    yield harness
    harness.close()


@pytest.fixture
def weight_sets():
    return TinyBigramModel.from_seed(0).state_dict(), TinyBigramModel.from_seed(1).state_dict()


@pytest.fixture
def bad_weight():
    def make(defect, original):
        name, rows = next(iter(original.items()))
        if defect == "name":
            return "no.such.weight", rows
        if defect == "shape":
            return name, rows[:-1]
        return name, _Float64Rows(rows)
    return make


class _Float64Rows(list):
    """Rows that say they are float64, as a tensor of the wrong dtype would."""

    dtype = "float64"

    def tolist(self):
        return [list(r) for r in self]


class TestMemoryEngine(EngineContract, WeightLoaderContract):
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
