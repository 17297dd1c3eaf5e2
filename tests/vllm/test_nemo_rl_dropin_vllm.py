"""NeMo-RL's drop-in DynamoGeneration over a real vLLM worker (Ray, the real frontend): built
from NeMo-RL's config dict, its rollouts equal the engine's own, a refit through its NeMo-RL
methods changes what it serves (and a refit back restores it), and shutdown leaves nothing."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rollout_fleet.adapters.collective import TrainerRefitSession
from rollout_fleet.adapters.shared import free_port
from rollout_fleet.wiring.nemo_rl import DynamoGeneration
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before

from .conftest import MODEL_SEED, OTHER_SEED

pytestmark = [pytest.mark.ray, pytest.mark.dynamo]
MAX_NEW = 12


def nemo_rl_config(model_folder) -> dict:
    return {
        "backend": "dynamo", "model_name": str(model_folder), "max_new_tokens": MAX_NEW,
        "temperature": 0.0, "top_p": 1.0, "top_k": None, "stop_strings": None,
        "stop_token_ids": None, "_pad_token_id": 0,
        "dynamo_cfg": {"engine": "vllm", "startup_timeout_s": 600, "request_timeout_s": 120,
                       "control_timeout_s": 120, "worker_args": {},
                       "frontend_args": {"router_mode": "round-robin"}},
        "vllm_cfg": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "precision": "float32",
                     "max_model_len": 512, "enforce_eager": True, "expose_http_server": False,
                     "enable_vllm_metrics_logger": False},
        "vllm_kwargs": {},
        # A CPU worker of this machine; 1 MiB refit buffers (the tiny model is a few MiB).
        "rollout_fleet": {"num_workers": 1, "refit": {"buffer_bytes": 1 << 20, "num_buffers": 2}},
    }


def batch(prompts):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])}


def generated(dropin, prompts) -> dict[int, tuple[list[int], list[float]]]:
    async def run():
        return [pair async for pair in dropin.generate_async(batch(prompts))]

    out = {}
    for index, sample in asyncio.run(run()):
        n = len(prompts[index])
        out[index] = (sample["output_ids"][0, n:].tolist(), sample["logprobs"][0, n:].tolist())
    return out


def refit(dropin, state_dict) -> None:
    port = free_port("127.0.0.1")
    world_size = 1 + dropin.get_inference_world_size()
    joining = dropin.init_collective("127.0.0.1", port, world_size, train_world_size=1)
    with TrainerRefitSession("127.0.0.1", port, 0, world_size, timeout_s=120,
                             spec=dropin.native.get_collective_sender_spec()) as trainer:
        ray.get(joining, timeout=120)
        dropin.prepare_refit_info({name: (tuple(t.shape), "float32") for name, t in state_dict.items()})
        updating = dropin.update_weights_from_collective()
        trainer.send_state_dict(state_dict, dropin.refit_info)
        ray.get(updating, timeout=120)
    assert dropin.finish_generation() is True


def test_dropin_over_vllm_generates_refits_and_shuts_down(tiny_models, vllm_engine, weights):
    prompts = [list(p) for p in vllm_engine.prompts[:4]]
    before = own_children_before()
    dropin = DynamoGeneration(None, nemo_rl_config(tiny_models[MODEL_SEED]))
    fleet = dropin._fleet
    pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
    ports = fleet_ports(fleet)
    try:
        original = generated(dropin, prompts)
        for index, prompt in enumerate(prompts):
            direct = vllm_engine.serve(prompt, MAX_NEW)  # the engine's own greedy answer
            tokens, logprobs = original[index]
            assert tokens == list(direct.token_ids)
            assert logprobs == pytest.approx(list(direct.logprobs), abs=1e-6)

        refit(dropin, weights[OTHER_SEED])
        changed = generated(dropin, prompts)
        assert changed != original, "a refit to other weights changed nothing"
        refit(dropin, weights[MODEL_SEED])
        restored = generated(dropin, prompts)
        assert {i: t for i, (t, _) in restored.items()} == {i: t for i, (t, _) in original.items()}
        assert set(dropin.native.get_weight_versions().values()) == {2}
    finally:
        assert dropin.shutdown() is True
    assert_nothing_left(pgids, ports, before)


@pytest.fixture
def ray_with_inference_group():
    """NeMo-RL's inference cluster: Ray running, one bundle reserved for the engine's rank."""
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    group = placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=60)
    yield [group]
    remove_placement_group(group)
    ray.shutdown()


def test_grpo_replay_over_vllm_with_a_tied_embedding_model(ray_with_inference_group, tmp_path):
    """The GRPO replay (tests/support/grpo_replay.py) with NeMo-RL's example config values over
    a real vLLM worker (KV routing), started with NeMo-RL's ``load_format: dummy``: the
    trainer's state dict of a tied-embedding model holds
    ``lm_head.weight``, which the checkpoint lacks; it is accepted and, as vLLM's loader does,
    ignored: garbage there changes nothing, other weights change the answers."""
    import torch

    from rollout_fleet.adapters.tiny_model import TinyModelSpec, build_tiny_model, tiny_state_dict
    from tests.support.grpo_replay import (
        InferenceCluster, Policy, configure_generation_config, replay,
    )
    from tests.support.nemo_rl_example_config import example_generation_config

    spec = TinyModelSpec(tie_word_embeddings=True)
    folder = build_tiny_model(tmp_path / "tied", seed=MODEL_SEED, spec=spec)

    def trainer_weights(seed, lm_head=None):
        weights = tiny_state_dict(seed, spec)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"] if lm_head is None else lm_head
        return weights  # float32, the engine's dtype

    original = trainer_weights(MODEL_SEED)
    garbage = torch.randn(original["lm_head.weight"].shape, generator=torch.Generator().manual_seed(9))
    # NeMo-RL's example config values (its checks take precision bfloat16 only); on
    # this CPU the engine runs float32 (greedy answers compared for equality must not sit on
    # bfloat16 near-ties), set in the fleet's own section; 1 MiB refit buffers.
    example = example_generation_config()
    config = configure_generation_config(example, model=str(folder), pad_token_id=0, eos_token_id=2)
    config["rollout_fleet"] = {"engine": {"dtype": "float32"},
                               "refit": {"buffer_bytes": 1 << 20, "num_buffers": 2}}
    served: list[list[list[int]]] = []
    prompts = [[1, 40 + i, 80 + 2 * i, 120 + 3 * i] for i in range(4)]
    outcome = replay(
        config, InferenceCluster(ray_with_inference_group), Policy(original), prompts=prompts,
        # the replay checks after each step's refit: the first step trains back to the
        # checkpoint's own weights, so its answers are the checkpoint's
        pad=0, steps=[original, trainer_weights(OTHER_SEED),
                      trainer_weights(MODEL_SEED, lm_head=garbage)],
        check=lambda out, _weights: served.append(out["output_ids"].tolist()))
    first, other, tied_again = served
    assert other != first, "a refit to other weights changed nothing"
    assert tied_again == first  # the garbage lm_head.weight was skipped, as vLLM's loader does
    assert set(outcome["versions"].values()) == {4}  # the first sync and three refits
    assert outcome["payload_mode"] == "hf_export"  # asked of the backend, as NeMo-RL's sync does
    assert outcome["step_metrics"] == [{"retried_attempts": 0.0}] * 3  # nothing sent twice
