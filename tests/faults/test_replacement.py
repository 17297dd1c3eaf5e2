"""A worker that joins a running fleet (a replacement for a lost one): it is registered but
serves nothing until the trainer's next refit has loaded the fleet's current weights on it, and
it then takes the fleet's weight version. Real Dynamo frontend, memory-engine workers placed as
local processes, a real gloo refit group."""

from __future__ import annotations

import time

import pytest
import torch

from rollout_fleet.adapters.collective import TrainerRefitSession
from rollout_fleet.adapters.memory.engine import TinyBigramModel
from rollout_fleet.adapters.shared import free_port
from rollout_fleet.core.errors import RefitError
from rollout_fleet.wiring.fleet import call_control
from tests.driver.conftest import engine_answers
from tests.faults.conftest import collect_until_error, mixed_batch, run
from tests.support.drills import FaultDrills
from tests.support.lost_worker import wait_until_lost

pytestmark = [pytest.mark.faults, pytest.mark.dynamo, pytest.mark.collective]
MAX_NEW, MAX_LEN = 16, 64


def refit(generation, seed: int) -> list[int]:
    """The trainer (rank 0) forms the group with every worker and sends the weights of
    ``seed``; returns the versions the workers report."""
    weights = {name: torch.tensor(matrix, dtype=torch.float32) for name, matrix
               in TinyBigramModel.from_seed(seed).state_dict().items()}
    world = 1 + generation.get_inference_world_size()
    port = free_port()
    joining = generation.init_collective("127.0.0.1", port, world, train_world_size=1)
    with TrainerRefitSession("127.0.0.1", port, 0, world, timeout_s=60,
                             spec=generation.get_collective_sender_spec()) as trainer:
        [f.result(timeout=60) for f in joining]
        info = generation.prepare_refit_info(
            {n: (tuple(t.shape), "float32") for n, t in weights.items()})
        updates = generation.update_weights_from_collective()
        trainer.send_state_dict(weights, info)
        return [f.result(timeout=60)["weight_version"] for f in updates]


def check_batch_served_by(generation, seed: int, count: int, batch_seed: int) -> None:
    """``count`` greedy rollouts, each exactly the engine's own answer under the weights of
    ``seed`` (a worker still on other weights would answer otherwise)."""
    prompts, data = mixed_batch(count, seed=batch_seed, max_len=20)
    pairs, error = run(collect_until_error(generation, data))
    assert error is None, repr(error)
    assert sorted(i for i, _ in pairs) == list(range(count))
    answers = engine_answers(prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN, seed=seed)
    for index, sample in pairs:
        assert sample["output_ids"][0].tolist() == prompts[index] + list(answers[index].token_ids)


def stats(fleet, name: str) -> dict:
    return call_control(fleet.control_urls[name], "stats", fleet.secret)


def wait_until_serving(fleet, generation, name: str, seed: int, timeout_s: float = 30.0) -> None:
    """The frontend tries a worker it kept away from again every few seconds; meanwhile every
    rollout is still the ``seed`` weights' answer."""
    deadline = time.monotonic() + timeout_s
    while stats(fleet, name)["served"] == 0:
        assert time.monotonic() < deadline, f"{name} served nothing within {timeout_s:.0f} s"
        check_batch_served_by(generation, seed, 4, batch_seed=40)


def test_a_replacement_serves_only_once_the_next_refit_loaded_the_current_weights(start_fleet):
    fleet = start_fleet(workers=2)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=16)
    try:
        assert refit(generation, seed=1) == [1, 1]
        FaultDrills(fleet).kill_worker("worker-0")
        wait_until_lost(fleet, "worker-0")
        replacement = fleet.add_worker(replacing="worker-0")
        assert replacement.name == "worker-2"
        held = stats(fleet, "worker-2")
        assert held["held"] is True and held["served"] == 0

        # Held: every rollout comes from worker-1, on the trainer's weights (seed 1); the
        # replacement started on the model's own (seed 0) and would answer otherwise.
        check_batch_served_by(generation, 1, 32, batch_seed=31)
        assert stats(fleet, "worker-2")["served"] == 0
        assert generation.get_inference_world_size() == 2  # asks the fleet who left and joined
        assert generation.worker_ids == ("worker-1", "worker-2")
        assert generation.get_weight_versions() == {"worker-1": 1, "worker-2": 0}

        # The group formed before the change cannot carry a refit: the trainer forms it again.
        with pytest.raises(RefitError, match=r"joined: \['worker-2'\], left: \['worker-0'\]"):
            generation.update_weights_from_collective()
        assert refit(generation, seed=2) == [2, 2]  # the replacement takes the fleet's version
        assert stats(fleet, "worker-2")["held"] is False
        wait_until_serving(fleet, generation, "worker-2", seed=2)
        check_batch_served_by(generation, 2, 32, batch_seed=32)
        assert generation.get_weight_versions() == {"worker-1": 2, "worker-2": 2}
    finally:
        generation.shutdown()


def test_with_replace_lost_workers_the_fleet_starts_a_replacement_by_itself(start_fleet):
    fleet = start_fleet(workers=2, replace_lost_workers=True)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=16)
    try:
        FaultDrills(fleet).kill_worker("worker-1")
        assert list(wait_until_lost(fleet, "worker-1")) == ["worker-1"]
        deadline = time.monotonic() + 120
        while "worker-2" not in [e.worker_id for e in fleet.endpoints(live_only=True)]:
            assert time.monotonic() < deadline, "no replacement joined within 120 s"
            time.sleep(0.2)
        assert stats(fleet, "worker-2")["held"] is True
        assert generation.get_inference_world_size() == 2
        assert generation.worker_ids == ("worker-0", "worker-2")
        assert refit(generation, seed=1) == [1, 1]
        wait_until_serving(fleet, generation, "worker-2", seed=1)
    finally:
        generation.shutdown()

