"""The vLLM adapter passes the same engine and weight-loading contract suites as the in-memory engine."""

import pytest

from rollout_fleet.ports.contracts.engine import EngineContract, WeightLoaderContract

from .conftest import MODEL_SEED, OTHER_SEED


@pytest.fixture(scope="class")
def engine_under_test(vllm_engine):
    return vllm_engine


@pytest.fixture
def weight_sets(weights):
    return weights[MODEL_SEED], weights[OTHER_SEED]


@pytest.fixture
def bad_weight():
    def make(defect, original):
        name, tensor = next(iter(original.items()))
        if defect == "name":
            return "model.layers.0.no_such_proj.weight", tensor
        if defect == "shape":
            return name, tensor[:-1]
        return name, tensor.double()
    return make


class TestVllmEngine(EngineContract, WeightLoaderContract):
    pass
