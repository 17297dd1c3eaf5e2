"""A worker whose engine dies mid-batch (the memory engine's fault drill: it fails as a killed
vLLM engine core does): the worker leaves the frontend's routing and the fleet, its rollouts are
retried on the survivor (each sample exactly once, equal to the engine's own answer), the fleet
reports it lost, and the next refit forms its group with the survivor alone."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from rollout_fleet.adapters.collective import TrainerRefitSession
from rollout_fleet.adapters.memory.engine import TinyBigramModel
from rollout_fleet.adapters.shared import free_port
from rollout_fleet.core.retry import RetryPolicy
from tests.driver.conftest import engine_answers
from tests.faults.conftest import check_batch_exactly_once, collect_until_error, mixed_batch, run
from tests.support.lost_worker import (
    RoutingProbe, kill_memory_engine, retryable, wait_for_in_flight, wait_until_lost,
)

pytestmark = [pytest.mark.faults, pytest.mark.dynamo, pytest.mark.collective]
MAX_NEW, MAX_LEN = 16, 64
NEW_WEIGHTS_SEED = 1


def test_an_engine_that_dies_mid_batch_leaves_the_fleet_and_the_next_refit_skips_it(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.01)
    prompts, data = mixed_batch(96, seed=21, max_len=20)
    retry = RetryPolicy(max_attempts=8, base_delay_s=0.05, backoff=1.5, max_delay_s=0.5)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=32, retry=retry)
    killed: dict = {}
    # Started at the kill (before it, its own requests would count as the worker's in flight).
    probe = RoutingProbe(fleet.frontend_url, "mem")

    async def batch_with_an_engine_killed():
        async def kill_when_busy():
            # the worker's own count of rollouts in flight, read just before the kill
            killed["in_flight"] = await asyncio.to_thread(wait_for_in_flight, fleet, "worker-0")
            killed["at"] = time.monotonic()
            await asyncio.to_thread(kill_memory_engine, fleet.control_urls["worker-0"], fleet.secret)
            probe.start()
            lost = await asyncio.to_thread(wait_until_lost, fleet, "worker-0")
            killed["lost"], killed["lost_after_s"] = lost, time.monotonic() - killed["at"]
        kill = asyncio.ensure_future(kill_when_busy())
        result = await collect_until_error(generation, data)
        await kill
        return result

    try:
        with probe:
            pairs, error = run(batch_with_an_engine_killed())
            lost, lost_after_s = killed["lost"], killed["lost_after_s"]
            time.sleep(0.5)  # probes after the worker left
        assert killed["in_flight"] > 0, "worker-0's engine held no rollout when it died"
        assert error is None, repr(error)
        check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
        assert list(lost) == ["worker-0"] and "memory engine died" in lost["worker-0"], lost
        refused = probe.refused_after(killed["at"])
        assert probe.served_after(killed["at"]) > 0
        assert all(retryable(status) for _, status, _ in refused), refused  # never a 400
        print(f"\nkill -> worker reported lost: {lost_after_s:.2f} s; probes refused after the "
              f"kill (s, status): {refused}")

        # The next refit: the survivor alone forms the group (world size 1 + 1, rank 1).
        assert generation.get_inference_world_size() == 1
        assert generation.worker_ids == ("worker-1",)
        new_weights = {name: torch.tensor(matrix, dtype=torch.float32) for name, matrix
                       in TinyBigramModel.from_seed(NEW_WEIGHTS_SEED).state_dict().items()}
        port = free_port()
        joining = generation.init_collective("127.0.0.1", port, 2, train_world_size=1)
        with TrainerRefitSession("127.0.0.1", port, 0, 2, timeout_s=60,
                                 spec=generation.get_collective_sender_spec()) as trainer:
            assert [f.result(timeout=60)["ranks"] for f in joining] == [[1]]
            info = generation.prepare_refit_info(
                {n: (tuple(t.shape), "float32") for n, t in new_weights.items()})
            updates = generation.update_weights_from_collective()
            trainer.send_state_dict(new_weights, info)
            assert [f.result(timeout=60)["weight_version"] for f in updates] == [1]
        assert generation.get_weight_versions() == {"worker-1": 1}
        assert generation.invalidate_kv_cache() is True
        more_prompts, more_data = mixed_batch(16, seed=22, max_len=20)
        more_pairs, error = run(collect_until_error(generation, more_data))
        assert error is None, repr(error)
        answers = engine_answers(more_prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                 seed=NEW_WEIGHTS_SEED)
        assert sorted(i for i, _ in more_pairs) == list(range(16))
        for index, sample in more_pairs:
            assert sample["output_ids"][0].tolist() == more_prompts[index] + list(
                answers[index].token_ids)
    finally:
        generation.shutdown()


def test_a_rollout_waiting_on_a_dead_engine_is_answered_503(start_fleet):
    """The engine dies while a rollout waits on it (here: in a 60 s pause between tokens, so the
    engine itself never gets back to it): the worker answers it 503, which the driver retries,
    before it leaves; not a hang until the client gives up."""
    fleet = start_fleet(workers=1, token_delay_s=60.0)
    body = json.dumps({"model": "mem", "prompt": [3, 4], "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{fleet.frontend_url}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    answer: dict = {}

    def ask():
        try:
            urllib.request.urlopen(request, timeout=30).read()
            answer["status"] = 200
        except urllib.error.HTTPError as error:
            answer["status"] = error.code
        except OSError as error:  # no answer within 30 s: it waited on the dead engine
            answer["status"] = repr(error)

    waiting = threading.Thread(target=ask)
    waiting.start()
    wait_for_in_flight(fleet, "worker-0")
    kill_memory_engine(fleet.control_urls["worker-0"], fleet.secret)
    waiting.join(60)
    assert answer == {"status": 503}
    lost = wait_until_lost(fleet, "worker-0")
    assert "memory engine died" in lost["worker-0"], lost
