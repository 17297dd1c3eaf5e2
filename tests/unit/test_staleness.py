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


def test_one_gate_paces_rollouts_on_two_loops_and_a_blocking_refit_from_a_third_thread():
    """The driver's shape: generate_async callers on their own loops, the trainer's refit from
    a plain thread. Each rollout records the versions current when it started and ended."""
    import threading
    import time

    gate = StalenessGate(1)
    spans, errors = [], []

    async def rollouts(count):
        for _ in range(count):
            async with gate.rollout() as admitted:
                await asyncio.sleep(0.002)
                spans.append(gate.current_version - admitted)

    def loop_thread(count):
        try:
            asyncio.run(rollouts(count))
        except BaseException as exc:  # reported below: a thread's error is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=loop_thread, args=(150,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    refits = 0
    while any(t.is_alive() for t in threads):
        new_version = gate.begin_refit(timeout_s=30)
        time.sleep(0.003)  # the transfer
        gate.end_refit(True)
        refits += 1
        assert gate.current_version == new_version
    for thread in threads:
        thread.join()
    assert errors == [] and len(spans) == 300
    assert refits > 2 and max(spans) <= 1 and gate.max_lag_seen <= 1


def test_a_failed_refit_keeps_the_version_and_a_stuck_one_times_out_by_name():
    from rollout_fleet.core.staleness import StalenessTimeout

    gate = StalenessGate(0)
    assert gate.begin_refit(timeout_s=1) == 1
    gate.end_refit(False)
    assert gate.current_version == 0

    async def hold_old_rollout_then_refit():
        async with gate.rollout():
            await asyncio.sleep(0)
            return await asyncio.to_thread(_refit_within, gate, 0.2)

    error = asyncio.run(hold_old_rollout_then_refit())
    assert isinstance(error, StalenessTimeout) and "staleness bound (0)" in str(error)
    assert gate.current_version == 0 and gate.begin_refit(timeout_s=1) == 1  # nothing held on


def _refit_within(gate, timeout_s):
    try:
        gate.begin_refit(timeout_s=timeout_s)
    except Exception as exc:
        return exc
    return None
