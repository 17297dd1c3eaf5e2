"""Trust: the control channel answers only the fleet's owner, the secret shows up in no command
line, environment, log or file others can read, and the fleet listens on loopback.

Workers run the memory engine, whose weights can be refit, so "changed nothing" is checked on
what matters: the weight version each worker reports and the greedy outputs of a fixed batch.
A real refit with the right secret (over gloo, the test process as the trainer) shows the same
channel does change both when the caller is the owner.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import urllib.error
import urllib.request

import attrs
import pytest
import torch

from rollout_fleet.adapters.collective import TrainerRefitSession
from rollout_fleet.adapters.memory import MemoryEngine
from rollout_fleet.adapters.memory.engine import TinyBigramModel
from rollout_fleet.core.errors import ControlRefused, RolloutFleetError
from rollout_fleet.core.rollout import GREEDY
from rollout_fleet.wiring.driver import build_generation
from rollout_fleet.adapters.shared import free_port
from tests.driver.conftest import check_sample
from tests.faults.conftest import collect_until_error, mixed_batch, run
from tests.support import listening_sockets
from tests.support.trust import descendants, open_to_others, secret_leaks

pytestmark = [pytest.mark.faults, pytest.mark.dynamo, pytest.mark.collective]
MAX_NEW, MAX_LEN = 12, 64
CONTROLS = ("init_collective", "prepare_refit_info", "update_weights", "flush_cache",
            "weight_version", "stats", "engine_stats", "abort_rollout", "kill_engine")
NEW_WEIGHTS_SEED = 1


def post_control(system_url: str, name: str, body: dict) -> dict:
    request = urllib.request.Request(f"{system_url}/engine/control/{name}",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            status, data = answer.status, json.load(answer)
    except urllib.error.HTTPError as refused:
        status, data = refused.code, json.load(refused)
    # A secret refused is a 401, whatever else a 200: a client reading statuses is not misled.
    refusal = data.get("status") == "error" and "refused" in str(data.get("message"))
    assert status == (401 if refusal else 200), (status, data)
    return data


def stranger_bodies() -> dict[str, dict]:
    """Plausible bodies for each control (a stranger who knows the API but not the secret)."""
    spec = {"protocol": "vllm", "buffer_bytes": 1 << 20, "num_buffers": 2}
    return {
        "init_collective": {"host": "127.0.0.1", "port": 1, "world_size": 3, "first_rank": 1,
                            "ranks_per_worker": 1, "train_world_size": 1, "sender_spec": spec,
                            "timeout_s": 5},
        "prepare_refit_info": {"refit_info": {"tensors": []}},
        "update_weights": {}, "flush_cache": {}, "weight_version": {}, "stats": {},
        "engine_stats": {}, "abort_rollout": {"request_id": "rollout-of-another"},
        "kill_engine": {},
    }


def greedy_outputs(generation, data):
    pairs, error = run(collect_until_error(generation, data))
    assert error is None, repr(error)
    return {index: sample["output_ids"][0].tolist() for index, sample in pairs}, dict(pairs)


def expected_answers(prompts, weights: dict | None, version: int = 0):
    """The memory engine's own greedy answers, with ``weights`` in place when given, tagged as
    served by weight ``version`` (what a fleet that was refit ``version`` times reports)."""
    async def answers():
        engine = MemoryEngine(seed=0, context_length=MAX_LEN)
        if weights is not None:
            engine.model = TinyBigramModel(weights["embed.weight"].tolist(),
                                           weights["lm_head.weight"].tolist())
        return [await engine.serve_rollout(p, request_id=f"own-{i}", sampling=GREEDY,
                                           max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)]
    return [attrs.evolve(answer, weight_version=version,
                         weight_versions=[(version, n) for _, n in answer.weight_versions])
            for answer in asyncio.run(answers())]


def test_controls_without_the_secret_are_refused_and_change_nothing_then_the_owner_refits(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.001)
    prompts, data = mixed_batch(24, seed=31, max_len=20)
    owner = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN, max_in_flight=24)
    try:
        versions_before = owner.get_weight_versions()
        outputs_before, samples = greedy_outputs(owner, data)
        for index, answer in enumerate(expected_answers(prompts, None)):
            check_sample(samples[index], prompts[index], answer)
        assert set(versions_before.values()) == {0}

        # Strangers: no secret, a wrong one, the right one with a byte changed, a non-string.
        bodies = stranger_bodies()
        wrong_secrets = [None, "wrong", fleet.secret[:-1] + ("0" if fleet.secret[-1] != "0" else "1"),
                         12345]
        for worker in fleet.workers:
            for name in CONTROLS:
                for secret in wrong_secrets:
                    body = dict(bodies[name])
                    if secret is not None:
                        body["control_secret"] = secret
                    answer = post_control(fleet.control_url(worker), name, body)
                    assert answer.get("status") == "error" and "refused" in answer.get("message", ""), \
                        (worker.name, name, secret, answer)
        # A driver with the fleet's endpoints and a wrong secret is refused on every control.
        stranger = build_generation(owner.config, frontend_url=fleet.frontend_url, workers=fleet.endpoints(),
                                    control_secret="not-the-secret")
        try:
            for call in (stranger.get_weight_versions, stranger.invalidate_kv_cache,
                         lambda: stranger.prepare_refit_info(
                             {n: ((48, 8), "float32") for n in ("embed.weight", "lm_head.weight")})):
                with pytest.raises(RolloutFleetError) as refused:
                    call()
                assert "refused" in str(refused.value), str(refused.value)
            futures = stranger.init_collective("127.0.0.1", 1, 3, train_world_size=1)
            for future in futures:
                with pytest.raises(ControlRefused):
                    future.result(timeout=30)
        finally:
            stranger.shutdown()
        assert owner.get_weight_versions() == versions_before
        assert greedy_outputs(owner, data)[0] == outputs_before

        # The owner's refit over the same channel: joins, is told the layout, and then a
        # stranger's update and flush in the middle are still refused.
        new_weights = {name: torch.tensor(matrix, dtype=torch.float32) for name, matrix in
                       TinyBigramModel.from_seed(NEW_WEIGHTS_SEED).state_dict().items()}
        port = free_port()
        world_size = 1 + owner.get_inference_world_size()
        joining = owner.init_collective("127.0.0.1", port, world_size, train_world_size=1)
        with TrainerRefitSession("127.0.0.1", port, 0, world_size, timeout_s=60,
                                 spec=owner.get_collective_sender_spec()) as trainer:
            for future in joining:
                future.result(timeout=60)
            info = owner.prepare_refit_info({n: (tuple(t.shape), "float32") for n, t in new_weights.items()})
            for worker in fleet.workers:
                for name in ("update_weights", "flush_cache"):
                    answer = post_control(fleet.control_url(worker), name, {"control_secret": "wrong"})
                    assert answer.get("status") == "error" and "refused" in answer["message"]
            assert owner.get_weight_versions() == versions_before
            updates = owner.update_weights_from_collective()
            trainer.send_state_dict(new_weights, info)
            for future in updates:
                future.result(timeout=60)
        versions_after = owner.get_weight_versions()
        assert set(versions_after) == set(versions_before) and set(versions_after.values()) == {1}
        outputs_after, samples = greedy_outputs(owner, data)
        assert outputs_after != outputs_before
        for index, answer in enumerate(expected_answers(prompts, new_weights, version=1)):
            check_sample(samples[index], prompts[index], answer)
    finally:
        owner.shutdown()


def test_a_pickled_copy_carries_the_secret_and_works(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.001)
    prompts, data = mixed_batch(12, seed=32, max_len=20)
    owner = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
    copy = pickle.loads(pickle.dumps(owner))
    try:
        assert copy.is_copy and copy.worker_ids == owner.worker_ids
        assert copy.get_weight_versions() == {w.name: 0 for w in fleet.workers}  # needs the secret
        assert copy.invalidate_kv_cache() is True
        _, samples = greedy_outputs(copy, data)
        for index, answer in enumerate(expected_answers(prompts, None)):
            check_sample(samples[index], prompts[index], answer)
    finally:
        copy.shutdown()
        owner.shutdown()
    assert fleet.secret not in repr(copy) and fleet.secret not in repr(copy._members.controls)


def test_a_local_fleet_listens_on_loopback_only_and_shows_its_secret_nowhere(start_fleet):
    fleet = start_fleet(workers=3, token_delay_s=0.001)
    for worker in fleet.workers:  # the right secret and a wrong one: both may be logged
        assert post_control(fleet.control_url(worker), "stats",
                            {"control_secret": fleet.secret})["status"] == "ok"
        assert post_control(fleet.control_url(worker), "stats",
                            {"control_secret": fleet.secret[::-1]})["status"] == "error"
    # Every process of the fleet: the frontend, each worker and whatever it started.
    pids = descendants(os.getpid())
    assert {w.pid for w in fleet.workers} | {fleet.frontend.process.pid} <= set(pids)
    listeners = listening_sockets(pids)
    ports = {s.port for s in listeners}
    assert fleet.frontend.http_port in ports
    assert {w.ports["DYN_SYSTEM_PORT"] for w in fleet.workers} <= ports
    outside = [s for s in listeners if not s.is_loopback]
    assert outside == [], f"listening beyond loopback: {outside}"
    assert secret_leaks(fleet.secret, [os.getpid(), *pids], [fleet.run_dir]) == []
    assert open_to_others(fleet.run_dir) == []
    assert len(list(fleet.run_dir.glob("worker-*.json"))) == 3
