"""A fleet whose workers change between refits: the coordinator refuses a refit over a group
formed before the change, and a worker that joined takes the fleet's weight version."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import (
    LocalWorkerControl, MemoryCollective, MemoryEngine, MemoryWeightSender, TinyBigramModel,
)
from rollout_fleet.core.errors import InvalidValue, RefitError, WorkerFailures
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo, next_version
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit

SPEC = CollectiveSenderSpec(buffer_bytes=1024, num_buffers=2)


class Fleet:
    def __init__(self, n: int = 2) -> None:
        self.group = MemoryCollective()
        self.engines: dict[str, MemoryEngine] = {}
        self.workers: dict[str, WorkerRefit] = {}
        self.coordinator = RefitCoordinator([self.new_control(f"w{i}") for i in range(n)],
                                            timeout_s=5.0)

    def new_control(self, name: str) -> LocalWorkerControl:
        engine = self.engines[name] = MemoryEngine(seed=0, join_receiver=self._join)
        self.workers[name] = WorkerRefit(engine)
        return LocalWorkerControl(name, self.workers[name].controls())

    def _join(self, join, rank):  # the group the trainer formed last
        return self.group.join_receiver(join, rank)

    def refit(self, seed: int, *, form_group: bool = True) -> dict[str, int]:
        state = TinyBigramModel.from_seed(seed).state_dict()
        info = RefitInfo.from_state_dict_info({k: ((48, 8), "float32") for k in state})
        coordinator = self.coordinator

        async def go():
            if form_group:
                self.group = MemoryCollective()  # a new group, as the trainer forms again
                world = 1 + len(coordinator.worker_ids)
                await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, world, 1,
                                                                        SPEC))
            await coordinator.prepare_refit_info(info)
            updates = asyncio.ensure_future(coordinator.update_weights())
            await asyncio.sleep(0)
            await asyncio.to_thread(MemoryWeightSender(self.group, SPEC).send, info, state.items())
            return await updates

        return asyncio.run(go())


def test_a_worker_that_joined_takes_the_fleet_version_at_the_next_refit():
    fleet = Fleet(2)
    assert fleet.refit(1) == {"w0": 1, "w1": 1}
    assert fleet.refit(2) == {"w0": 2, "w1": 2}
    assert fleet.coordinator.add_workers([fleet.new_control("w2")]) == ("w2",)
    assert fleet.coordinator.newcomers == ("w2",)
    assert fleet.refit(3) == {"w0": 3, "w1": 3, "w2": 3}
    assert fleet.coordinator.newcomers == ()
    assert fleet.refit(4) == {"w0": 4, "w1": 4, "w2": 4}
    assert fleet.engines["w2"].model.embed == TinyBigramModel.from_seed(4).embed


def test_a_refit_over_a_group_formed_before_the_fleet_changed_is_refused_first():
    fleet = Fleet(2)
    assert fleet.refit(1) == {"w0": 1, "w1": 1}
    fleet.coordinator.forget_workers({"w0"})
    fleet.coordinator.add_workers([fleet.new_control("w2")])
    with pytest.raises(RefitError, match=r"joined: \['w2'\], left: \['w0'\].*world size of 2"):
        fleet.coordinator.update_weights_plan()
    assert [e.weight_version() for e in fleet.engines.values()] == [1, 1, 0]
    assert fleet.refit(2) == {"w1": 2, "w2": 2}


def test_a_worker_added_twice_is_added_once():
    fleet = Fleet(1)
    control = fleet.new_control("w1")
    assert fleet.coordinator.add_workers([control]) == ("w1",)
    assert fleet.coordinator.add_workers([control]) == ()
    assert fleet.coordinator.worker_ids == ("w0", "w1")


def test_a_failed_refit_keeps_the_newcomer_new():
    fleet = Fleet(1)
    assert fleet.refit(1) == {"w0": 1}
    fleet.coordinator.add_workers([fleet.new_control("w1")])
    fleet.coordinator.timeout_s = 0.3

    async def no_sender():
        fleet.group = MemoryCollective()
        await asyncio.gather(*fleet.coordinator.init_collective_calls("127.0.0.1", 1, 3, 1, SPEC))
        state = TinyBigramModel.from_seed(2).state_dict()
        await fleet.coordinator.prepare_refit_info(
            RefitInfo.from_state_dict_info({k: ((48, 8), "float32") for k in state}))
        await fleet.coordinator.update_weights()

    with pytest.raises(WorkerFailures):
        asyncio.run(no_sender())
    assert fleet.coordinator.newcomers == ("w1",)
    fleet.coordinator.timeout_s = 5.0
    assert fleet.refit(2) == {"w0": 2, "w1": 2}


@pytest.mark.parametrize("wanted", [0, 3, -1, 2.5, True, "4"])
def test_a_version_that_does_not_go_up_is_refused_naming_it(wanted):
    with pytest.raises(InvalidValue, match=r"weight_version"):
        next_version(3, wanted)


def test_next_version_is_one_up_or_the_one_asked():
    assert next_version(3) == 4
    assert next_version(0, 7) == 7


def test_a_worker_refuses_a_version_below_its_own_before_any_transfer():
    fleet = Fleet(1)
    assert fleet.refit(1) == {"w0": 1}  # the group is formed and the refit info known
    with pytest.raises(InvalidValue, match=r"weight_version=1.*above this engine's version 1"):
        asyncio.run(fleet.workers["w0"].update_weights({"weight_version": 1}))
    assert fleet.engines["w0"].weight_version() == 1
    assert fleet.refit(2, form_group=False) == {"w0": 2}  # nothing was consumed from the group
