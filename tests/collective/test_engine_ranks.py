"""Engines with several ranks (tensor x pipeline parallel) in a real gloo refit group: every rank
of every worker joins at T + i*E + j and receives every byte. In-memory engines with E = 4,
their ranks threads of this process, driven through the refit services as a fleet would."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rollout_fleet.adapters.collective import TorchWeightSender, init_group, join_receiver
from rollout_fleet.adapters.memory import LocalWorkerControl, MemoryEngine, TinyBigramModel
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit
from rollout_fleet.core.rollout import SamplingSpec
from tests.collective.harness import free_port

pytestmark = pytest.mark.collective
RANKS, WORKERS, TRAIN_RANKS = 4, 2, 1
SPEC = CollectiveSenderSpec(buffer_bytes=512, num_buffers=2)


def greedy(engine):
    return asyncio.run(engine.serve_rollout([3, 4], request_id="g", max_new_tokens=12,
                                            sampling=SamplingSpec())).token_ids


def fleet(ranks_in_layout=RANKS):
    engines = [MemoryEngine(seed=0, refit_ranks=RANKS, join_receiver=join_receiver)
               for _ in range(WORKERS)]
    controls = [LocalWorkerControl(f"w{i}", WorkerRefit(e).controls()) for i, e in enumerate(engines)]
    return engines, RefitCoordinator(controls, ranks_per_worker=ranks_in_layout, timeout_s=30)


def test_every_rank_of_every_worker_joins_at_its_place_and_receives_every_byte():
    engines, coordinator = fleet()
    world = TRAIN_RANKS + WORKERS * RANKS
    port = free_port()
    trainer: dict = {}
    joining = threading.Thread(target=lambda: trainer.update(
        group=init_group("127.0.0.1", port, 0, world, "gloo", 30.0)))
    joining.start()

    async def refit():
        joined = await asyncio.gather(*coordinator.init_collective_calls(
            "127.0.0.1", port, world, TRAIN_RANKS, SPEC))
        joining.join(30)
        state = {name: torch.tensor(rows) for name, rows in TinyBigramModel.from_seed(5).state_dict().items()}
        info = RefitInfo.from_state_dict_info({n: (tuple(t.shape), "float32") for n, t in state.items()})
        await coordinator.prepare_refit_info(info)
        updating = asyncio.ensure_future(coordinator.update_weights())
        await asyncio.to_thread(TorchWeightSender(trainer["group"], SPEC).send, info, state)
        return joined, await updating

    before = greedy(engines[0])
    try:
        joined, versions = asyncio.run(refit())
    finally:
        for engine in engines:
            engine.close_receivers()
        if "group" in trainer:
            trainer["group"].close()
    assert [answer["ranks"] for answer in joined] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert versions == {"w0": 1, "w1": 1}
    # Every rank received the same bytes as rank 0 (the engine refuses otherwise), and the
    # weights are the trainer's: both workers now answer as the seed-5 model does.
    expected = greedy(MemoryEngine(seed=5))
    assert [greedy(e) for e in engines] == [expected, expected] != [before, before]


def test_a_layout_that_disagrees_with_the_engines_rank_count_is_refused_by_every_worker():
    engines, coordinator = fleet(ranks_in_layout=2)
    async def join():
        await asyncio.gather(*coordinator.init_collective_calls(
            "127.0.0.1", free_port(), TRAIN_RANKS + WORKERS * 2, TRAIN_RANKS, SPEC))

    with pytest.raises(RolloutFleetError) as failure:
        asyncio.run(join())
    assert "ranks_per_worker" in str(failure.value) and "4 rank(s)" in str(failure.value)
