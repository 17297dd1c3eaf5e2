"""Refit services over in-memory ports: the coordinator, each worker's side, the memory collective."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import (
    LocalWorkerControl, MemoryCollective, MemoryEngine, MemoryWeightReceiver, MemoryWeightSender,
    TinyBigramModel,
)
from rollout_fleet.core.errors import RefitError, WorkerFailures, WorldSizeMismatch
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo, TensorMeta
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit
from rollout_fleet.core.rollout import SamplingSpec
from rollout_fleet.ports.contracts.collective import CollectiveContract, CollectiveUnderTest

SPEC = CollectiveSenderSpec(buffer_bytes=1024, num_buffers=2)


def make_fleet(n=2, timeout_s=5.0):
    group = MemoryCollective()
    engines = [MemoryEngine(seed=0, join_receiver=group.join_receiver) for _ in range(n)]
    workers = [WorkerRefit(engine) for engine in engines]
    controls = [LocalWorkerControl(f"w{i}", w.controls()) for i, w in enumerate(workers)]
    return group, engines, RefitCoordinator(controls, timeout_s=timeout_s)


def greedy(engine, prompt=(3, 4)):
    return asyncio.run(engine.serve_rollout(list(prompt), request_id="g", max_new_tokens=12,
                                            sampling=SamplingSpec())).token_ids


def refit_with(coordinator, group, state, spec=SPEC, info=None):
    info = info or RefitInfo.from_state_dict_info({k: ((48, 8), "float32") for k in state})

    async def go():
        await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 3, 1, SPEC))
        await coordinator.prepare_refit_info(info)
        updates = asyncio.ensure_future(coordinator.update_weights())
        await asyncio.sleep(0)
        await asyncio.to_thread(MemoryWeightSender(group, spec).send, info, state.items())
        versions = await updates
        await coordinator.invalidate_caches()
        return versions

    return asyncio.run(go())


def test_a_refit_reaches_every_worker_and_changes_outputs():
    group, engines, coordinator = make_fleet()
    before = [greedy(e) for e in engines]
    new_state = TinyBigramModel.from_seed(7).state_dict()
    versions = refit_with(coordinator, group, new_state)
    assert versions == {"w0": 1, "w1": 1}
    assert asyncio.run(coordinator.weight_versions()) == {"w0": 1, "w1": 1}
    expected = greedy(MemoryEngine(seed=7))
    assert [greedy(e) for e in engines] == [expected, expected] != before


def test_wrong_world_size_is_refused_before_any_worker_is_asked():
    _, _, coordinator = make_fleet()
    with pytest.raises(WorldSizeMismatch):
        coordinator.init_collective_calls("127.0.0.1", 1, 4, 1, SPEC)


@pytest.mark.parametrize("bad", [
    TensorMeta("nope", (48, 8), "float32"), TensorMeta("embed.weight", (8, 48), "float32"),
    TensorMeta("embed.weight", (48, 8), "bfloat16"),
])
def test_bad_refit_info_is_refused_on_every_worker_and_nothing_changes(bad):
    _, engines, coordinator = make_fleet()
    before = [greedy(e) for e in engines]
    with pytest.raises(WorkerFailures) as info:
        asyncio.run(coordinator.prepare_refit_info(RefitInfo((bad,))))
    assert set(info.value.failures) == {"w0", "w1"}
    assert [greedy(e) for e in engines] == before
    assert [e.weight_version() for e in engines] == [0, 0]


def test_a_sender_that_never_sends_times_out_and_the_old_weights_stay():
    group, engines, coordinator = make_fleet(timeout_s=0.5)
    before = [greedy(e) for e in engines]
    info = RefitInfo.from_state_dict_info({"embed.weight": ((48, 8), "float32")})

    async def go():
        await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 3, 1, SPEC))
        await coordinator.prepare_refit_info(info)
        await coordinator.update_weights()

    with pytest.raises(WorkerFailures) as failure:
        asyncio.run(go())
    assert set(failure.value.failures) == {"w0", "w1"}
    assert "no weights arrived within 0.5 s" in str(failure.value)
    assert [greedy(e) for e in engines] == before
    assert [e.weight_version() for e in engines] == [0, 0]


def test_update_before_init_is_a_clear_error():
    _, _, coordinator = make_fleet()
    with pytest.raises(RefitError) as info:
        asyncio.run(coordinator.update_weights())
    assert "before init_collective" in str(info.value)


@pytest.fixture
def collective_under_test():
    def make_group(sender_spec, receiver_specs):
        group = MemoryCollective()
        receivers = [MemoryWeightReceiver(group, rank, spec, timeout_s=2.0)
                     for rank, spec in enumerate(receiver_specs, start=1)]
        return MemoryWeightSender(group, sender_spec), receivers

    def state_dict():
        state = {"a": [[1.5, -2.0]], "b": [[0.0] * 3] * 2, "empty": []}
        info = RefitInfo((TensorMeta("a", (1, 2), "float32"), TensorMeta("b", (2, 3), "float32"),
                          TensorMeta("empty", (0,), "float32")))
        return info, state

    return CollectiveUnderTest(make_group, state_dict, lambda x, y: x == y)


class TestMemoryCollective(CollectiveContract):
    pass


def test_a_lost_worker_is_left_out_and_the_survivors_form_the_next_group():
    group, engines, coordinator = make_fleet(3)
    assert coordinator.forget_workers({"w1", "not-a-worker"}) == ("w1",)
    assert coordinator.worker_ids == ("w0", "w2")
    with pytest.raises(WorldSizeMismatch):  # 1 trainer + 3 workers is no longer the layout
        coordinator.init_collective_calls("127.0.0.1", 1, 4, 1, SPEC)
    plan = coordinator.init_collective_plan("127.0.0.1", 1, 3, 1, SPEC)
    assert [(call.worker_id, call.body["first_rank"]) for call in plan] == [("w0", 1), ("w2", 2)]
    versions = refit_with(coordinator, group, TinyBigramModel.from_seed(7).state_dict())
    assert versions == {"w0": 1, "w2": 1}
    assert [engine.weight_version() for engine in engines] == [1, 0, 1]


@pytest.mark.parametrize("step", ["prepare_refit_info", "update_weights"])
def test_a_refit_step_that_hangs_on_one_worker_is_bounded_and_names_that_worker(step):
    group = MemoryCollective()
    engines = [MemoryEngine(seed=0, join_receiver=group.join_receiver) for _ in range(2)]
    controls = [WorkerRefit(engine).controls() for engine in engines]

    async def never_answers(_body):
        await asyncio.Event().wait()  # a rank stuck in its step: no answer, no error

    controls[1] = {**controls[1], step: never_answers}
    coordinator = RefitCoordinator([LocalWorkerControl(f"w{i}", c) for i, c in enumerate(controls)],
                                   timeout_s=0.5)
    info = RefitInfo.from_state_dict_info({"embed.weight": ((48, 8), "float32")})
    state = {"embed.weight": TinyBigramModel.from_seed(1).state_dict()["embed.weight"]}

    async def go():
        await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 3, 1, SPEC))
        await coordinator.prepare_refit_info(info)
        updates = asyncio.ensure_future(coordinator.update_weights())
        await asyncio.sleep(0)
        sending = asyncio.to_thread(MemoryWeightSender(group, SPEC).send, info, state.items())
        await asyncio.gather(updates, sending, return_exceptions=True)
        return updates.result()

    with pytest.raises(WorkerFailures) as failure:
        asyncio.run(asyncio.wait_for(go(), 30))  # bounded here too: a hang fails the test
    assert "w1" in failure.value.failures
    assert f"{step} on worker w1 timed out after" in str(failure.value)
