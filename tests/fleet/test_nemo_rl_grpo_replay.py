"""NeMo-RL's GRPO call sequence in its newest order (lazy refits through the attached weight
synchroniser, validation after each step: tests/support/grpo_replay.py names the version read),
replayed against the drop-in with the values of NeMo-RL's example config
(``grpo_math_1B_dynamo.yaml``, restated in tests/support/nemo_rl_example_config.py; only what
NeMo-RL's setup writes into it, plus the CPU engine kind), and NeMo-RL's batch type, padding
check, config checks and weight synchroniser as this project restates them: memory-engine
workers placed into the placement groups of the inference cluster it is handed, refit each
step, greedy answers those of the weights sent."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from rollout_fleet.adapters.memory.engine import EOS_TOKEN_ID, MemoryEngine, TinyBigramModel
from rollout_fleet.adapters.memory.model_folder import write_model_folder
from rollout_fleet.core.rollout import GREEDY
from tests.driver.conftest import PAD, mixed_batch
from tests.support.grpo_replay import InferenceCluster, Policy, configure_generation_config, replay
from tests.support.nemo_rl_example_config import example_generation_config

pytestmark = pytest.mark.ray
CONTEXT = 512  # the example's max_total_sequence_length
WORKERS = 2


@pytest.fixture(scope="module")
def inference_groups():
    """NeMo-RL's inference cluster reserves its bundles before the backend starts."""
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    group = placement_group([{"CPU": 1}] * WORKERS)
    ray.get(group.ready(), timeout=60)
    yield [group]
    remove_placement_group(group)
    ray.shutdown()


def weights_of(seed: int) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(matrix, dtype=torch.float32)
            for name, matrix in TinyBigramModel.from_seed(seed).state_dict().items()}


def engine_answers(prompts, weights, max_new_tokens):
    async def answers():
        engine = MemoryEngine(seed=0, context_length=CONTEXT)
        engine.model = TinyBigramModel(weights["embed.weight"].tolist(),
                                       weights["lm_head.weight"].tolist())
        return [await engine.serve_rollout(p, request_id=f"own-{i}", sampling=GREEDY,
                                           stop_token_ids=[EOS_TOKEN_ID],
                                           max_new_tokens=max_new_tokens)
                for i, p in enumerate(prompts)]
    return asyncio.run(answers())


def test_grpo_replay_with_nemo_rls_example_config(inference_groups, tmp_path):
    from ray.util import placement_group_table

    folder = write_model_folder(tmp_path / "model", context_length=CONTEXT)
    example = example_generation_config()
    config = configure_generation_config(example, model=str(folder), pad_token_id=PAD,
                                         eos_token_id=EOS_TOKEN_ID)
    config["rollout_fleet"] = {"engine": {"kind": "memory", "seed": 0, "context_length": CONTEXT}}
    prompts, _ = mixed_batch(6, seed=21)
    max_new = config["max_new_tokens"]

    def check(out, served):
        for row, (prompt, answer) in enumerate(zip(prompts, engine_answers(prompts, served, max_new))):
            total = len(prompt) + len(answer.token_ids)
            assert out["output_ids"][row, :total].tolist() == prompt + list(answer.token_ids)
            assert out["unpadded_sequence_lengths"][row].item() == total

    groups_before = set(placement_group_table())
    cluster = InferenceCluster(inference_groups)
    outcome = replay(config, cluster, Policy(weights_of(5)), prompts=prompts, pad=PAD,
                     steps=[weights_of(7), weights_of(8)], check=check)
    assert set(placement_group_table()) == groups_before  # the cluster's groups, none of its own
    assert outcome["spec"].nccl_peer == "rollout-fleet-packed-v1"  # no NeMo-RL sender on the CPU
    assert set(outcome["versions"].values()) == {3}  # the first sync, then one per step's check
    assert outcome["payload_mode"] == "hf_export"  # asked of the backend, as NeMo-RL's sync does
    assert outcome["step_metrics"] == [{"retried_attempts": 0.0}] * 2  # nothing sent twice
    assert set(outcome["metrics"]) == {"inflight_batch_sizes", "num_pending_samples",
                                       "kv_cache_usage_perc", "generation_tokens"}
    assert set(outcome["metrics"]["generation_tokens"]) == set(range(WORKERS))
