"""NeMo-RL's colocated refit through the drop-in, on the CPU: the restated NeMo-RL sender
(support/nemo_rl_ipc_sender.py: ZeroMQ request/reply, two ping-pong buffers, 512-byte
aligned offsets, the final message; shared-memory handles where NeMo-RL sends CUDA IPC ones)
streams a model into a one-worker vLLM fleet built by ``DynamoGeneration`` (placed by Ray, its
futures Ray's, as in NeMo-RL), in NeMo-RL's order:
``prepare_for_generation(tags=["weights"])``, ``update_weights_via_ipc_zmq`` while the trainer
streams, ``prepare_for_generation(tags=["kv_cache"])``. Greedy answers after each refit are
transformers' greedy decodes of the weights streamed (tests/refit/conftest.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import ray
from safetensors.torch import load_file

from rollout_fleet.core.errors import ControlRefused
from tests.refit.conftest import EOS, STEPS
from tests.refit.test_refit_fleet import assert_serves, info_of
from support.nemo_rl_ipc_sender import TrainerRank

BUFFER_BYTES = 2 * (64 << 10)  # two 64 KiB buffers: many groups, the embeddings each alone
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def dropin(models, tmp_path_factory):
    from rollout_fleet.wiring.fleet import call_control
    from rollout_fleet.wiring.nemo_rl import DynamoGeneration
    from tests.fleet.test_nemo_rl_dropin import nemo_rl_config
    from tests.support.net import in_private_netns

    if not in_private_netns():
        pytest.fail("run the refit tier through scripts/test.sh (inside `unshare -n`)")
    config = nemo_rl_config(models[0], max_new_tokens=STEPS, stop_token_ids=[EOS])
    config["vllm_cfg"] = {**config["vllm_cfg"], "max_model_len": 512}
    # Placed by Ray, as NeMo-RL's are: the futures are Ray's, waited on with ray.get.
    config["rollout_fleet"] = {"device": "cpu", "num_workers": 1,
                               "run_dir": str(tmp_path_factory.mktemp("ipc-fleet"))}
    generation = DynamoGeneration(None, config)
    try:
        fleet = generation._fleet
        # Where the trainer rank binds (on a GPU NeMo-RL's own address of the shared device).
        address = call_control(fleet.control_url(fleet.workers[0]), "ipc_zmq_address",
                               fleet.secret)["address"]
        generation.prepare_refit_info(info_of(models[0]))  # NeMo-RL's init_communicator
        yield Dropin(generation, address)
    finally:
        generation.shutdown()


@dataclasses.dataclass
class Dropin:
    generation: Any
    address: str


def stream_and_update(dropin, named_tensors):
    """One refit in NeMo-RL's colocated order; the sender (its group counts) and the answers
    of ``update_weights_via_ipc_zmq``'s futures."""
    generation = dropin.generation
    assert generation.prepare_for_generation(tags=["weights"]) is True
    trainer = TrainerRank(dropin.address, named_tensors, BUFFER_BYTES, timeout_s=TIMEOUT_S)
    try:
        futures = generation.update_weights_via_ipc_zmq()
        answers = ray.get(futures, timeout=TIMEOUT_S)
    finally:
        trainer.join()
    # NeMo-RL's synchroniser: a literal True from each of dp_size workers, then coverage.
    assert len(futures) == generation.dp_size
    assert generation.refit_reconstructs_all_runtime_weights() is True
    assert generation.prepare_for_generation(tags=["kv_cache"]) is True
    return trainer.sender, answers


def model_tensors(folder):
    return list(load_file(str(folder / "model.safetensors")).items())


def test_the_restated_nemo_rl_sender_refits_the_worker_in_nemo_rls_order(dropin, models,
                                                                         reference):
    assert_serves(dropin.generation.native, reference, 0)
    assert dropin.generation.refit_reconstructs_all_runtime_weights() is False  # none yet
    for version, seed in ((1, 1), (2, 0)):
        sender, answers = stream_and_update(dropin, model_tensors(models[seed]))
        assert answers == [True]  # NeMo-RL counts a literal True per worker
        assert sender.groups > 3 and sender.oversized >= 1  # ping-pong and a buffer alone
        assert dropin.generation.native.get_weight_versions() == {"worker-0": version}
        assert_serves(dropin.generation.native, reference, seed)


def test_a_stream_with_a_tensor_the_refit_info_lacks_is_refused_and_the_weights_stay(
        dropin, models, reference):
    before = dropin.generation.native.get_weight_versions()
    tensors = model_tensors(models[1])
    tensors[3] = ("model.layers.0.no_such_weight", tensors[3][1])
    with pytest.raises(ControlRefused, match="model.layers.0.no_such_weight: not in the refit info"):
        stream_and_update(dropin, tensors)
    assert dropin.generation.native.get_weight_versions() == before
    serving = 0 if before["worker-0"] % 2 == 0 else 1  # model A at even versions
    assert_serves(dropin.generation.native, reference, serving)


def test_a_refit_the_worker_refuses_before_loading_is_drained_so_the_trainer_ends(
        dropin, models, reference):
    """A version that would not go up is refused before anything loads; every message is still
    answered, so the trainer's sender ends instead of waiting out its socket's timeout."""
    from rollout_fleet.core.refit import RefitInfo
    from rollout_fleet.wiring.fleet import call_control

    fleet, native = dropin.generation._fleet, dropin.generation.native
    before = native.get_weight_versions()
    body = {"refit_info": RefitInfo.from_state_dict_info(info_of(models[1])).to_wire(),
            "weight_version": before["worker-0"]}
    trainer = TrainerRank(dropin.address, model_tensors(models[1]), BUFFER_BYTES,
                          timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(ValueError, match="weight_version=.*must be an int above this"):
            call_control(fleet.control_url(fleet.workers[0]), "ipc_zmq_update", fleet.secret,
                         body, timeout_s=TIMEOUT_S)
    finally:
        trainer.join()  # the sender saw every message answered
    assert trainer.sender.groups > 3
    assert native.get_weight_versions() == before
    assert_serves(native, reference, 0 if before["worker-0"] % 2 == 0 else 1)
