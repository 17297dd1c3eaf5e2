"""The staleness bound under load: refits one after another while rollouts stream, on a fleet
of two memory engines refit through the real coordinator and worker controls."""

import asyncio
import random

import pytest

from rollout_fleet.adapters.memory import (
    EngineCompletionsTransport, LocalWorkerControl, MemoryCollective, MemoryEngine,
    MemoryWeightSender, TinyBigramModel,
)
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.rollout_client import RolloutClient
from rollout_fleet.core.staleness import StalenessGate

SPEC = CollectiveSenderSpec(buffer_bytes=1024, num_buffers=2)
REFITS = 8
SENDERS = 24
ROLLOUTS_PER_SENDER = 6


async def _load_with_refits(max_staleness):
    """Rollouts from SENDERS senders while a trainer refits REFITS times; every result, and the
    fleet's version when each refit ended, as the workers report it."""
    group = MemoryCollective()
    engines = [MemoryEngine(seed=0, context_length=512, token_delay_s=0.0005,
                            join_receiver=group.join_receiver) for _ in range(2)]
    coordinator = RefitCoordinator(
        [LocalWorkerControl(f"w{i}", WorkerRefit(e).controls()) for i, e in enumerate(engines)])
    clients = [RolloutClient(EngineCompletionsTransport(e), model="memory") for e in engines]
    gate = StalenessGate(max_staleness)
    await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 3, 1, SPEC))
    rng = random.Random(5)
    budgets = [rng.randint(8, 120) for _ in range(SENDERS * ROLLOUTS_PER_SENDER)]
    results, fleet_versions = [], []

    async def sender(k):
        for n in range(ROLLOUTS_PER_SENDER):
            request = RolloutRequest(f"s{k}-{n}", (3 + k % 5, 4), budgets[k * ROLLOUTS_PER_SENDER + n])
            async with gate.rollout():
                results.append(await clients[(k + n) % 2].rollout(request))

    async def trainer():
        for step in range(1, REFITS + 1):
            state = TinyBigramModel.from_seed(step).state_dict()
            info = RefitInfo.from_state_dict_info({k: ((48, 8), "float32") for k in state})
            await asyncio.sleep(0.01)  # "training"
            async with gate.refit():
                await coordinator.prepare_refit_info(info)
                updates = asyncio.ensure_future(coordinator.update_weights(mode="keep"))
                await asyncio.to_thread(MemoryWeightSender(group, SPEC).send, info, state.items())
                fleet_versions.append(await updates)

    await asyncio.gather(trainer(), *(sender(k) for k in range(SENDERS)))
    return results, fleet_versions, gate


def _observed_lag(result) -> int:
    """The workers' own figure: the version serving when the rollout ended, minus the version
    of its first token."""
    return result.weight_version - result.weight_versions[0][0]


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_refits_under_load_keep_the_lag_within_the_bound(bound):
    results, fleet_versions, gate = asyncio.run(_load_with_refits(bound))
    assert len(results) == SENDERS * ROLLOUTS_PER_SENDER  # nothing discarded, nothing lost
    assert fleet_versions == [{"w0": v, "w1": v} for v in range(1, REFITS + 1)]
    assert max(map(_observed_lag, results)) <= bound
    assert gate.max_lag_seen <= bound and gate.current_version == REFITS
    if bound == 0:
        assert all(len(r.weight_versions) == 1 for r in results)  # drained at every refit


def test_without_a_bound_the_same_load_runs_further_behind():
    """The check above can fail: unbounded, rollouts span several refits."""
    results, _, _ = asyncio.run(_load_with_refits(None))
    assert len(results) == SENDERS * ROLLOUTS_PER_SENDER
    assert max(map(_observed_lag, results)) > 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_bound_is_refused_by_name(bad):
    with pytest.raises(InvalidValue) as refused:
        StalenessGate(bad)
    assert refused.value.field == "max_staleness"
