"""A memory engine's refit ballast: bytes besides its model's that a refit carries and the
engine drops (bench/bench_scale.py refits a fleet with a model of a real size this way)."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import (
    LocalWorkerControl, MemoryCollective, MemoryEngine, MemoryWeightSender,
)
from rollout_fleet.adapters.memory.config import MemoryEngineConfig
from rollout_fleet.adapters.memory.model import BALLAST_PIECE_BYTES, TinyBigramModel, ballast_metas
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit
from rollout_fleet.core.rollout import SamplingSpec

SPEC = CollectiveSenderSpec(buffer_bytes=1 << 20, num_buffers=2)


def test_the_ballast_is_cut_into_byte_pieces_of_at_most_16_mib():
    metas = ballast_metas(2 * BALLAST_PIECE_BYTES + 5)
    assert [(m.name, m.shape, m.dtype) for m in metas.values()] == [
        ("ballast.0", (BALLAST_PIECE_BYTES,), "uint8"), ("ballast.1", (BALLAST_PIECE_BYTES,), "uint8"),
        ("ballast.2", (5,), "uint8")]
    assert ballast_metas(0) == {}


def test_the_setting_is_checked_and_reaches_the_engine():
    with pytest.raises(InvalidValue, match="refit_ballast_bytes"):
        MemoryEngineConfig.from_mapping({"refit_ballast_bytes": -1})
    engine = MemoryEngineConfig.from_mapping({"refit_ballast_bytes": 3}).engine()
    assert set(engine.weight_metas()) == {"embed.weight", "lm_head.weight", "ballast.0"}
    assert set(MemoryEngine().weight_metas()) == {"embed.weight", "lm_head.weight"}


def test_a_refit_carrying_ballast_loads_the_model_and_drops_the_ballast():
    group = MemoryCollective()
    engine = MemoryEngine(seed=0, join_receiver=group.join_receiver, refit_ballast_bytes=10)
    coordinator = RefitCoordinator([LocalWorkerControl("w0", WorkerRefit(engine).controls())],
                                   timeout_s=5.0)
    state = {**TinyBigramModel.from_seed(7).state_dict(), "ballast.0": list(range(10))}
    info = RefitInfo.from_state_dict_info({**{name: ((48, 8), "float32") for name in state
                                              if name != "ballast.0"},
                                           "ballast.0": ((10,), "uint8")})

    async def refit():
        await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 2, 1, SPEC))
        await coordinator.prepare_refit_info(info)
        updates = asyncio.ensure_future(coordinator.update_weights())
        await asyncio.sleep(0)
        await asyncio.to_thread(MemoryWeightSender(group, SPEC).send, info, state.items())
        return await updates

    assert asyncio.run(refit()) == {"w0": 1}
    assert engine.model.state_dict() == TinyBigramModel.from_seed(7).state_dict()
    served = asyncio.run(engine.serve_rollout([3, 4], request_id="r", max_new_tokens=8,
                                              sampling=SamplingSpec()))
    assert served.weight_version == 1
