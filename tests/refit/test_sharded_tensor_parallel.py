"""The many-source sharded refit inside a real vLLM engine with tensor_parallel_size = 2 on the
CPU: 2 trainer processes, each holding dim-0 shards of the new weights, send at once; each of
vLLM's two engine ranks receives only its planned slices (its vocabulary-parallel tensors
whole, the fallback) and loads them through vLLM's own loaders; the engine then serves the new
weights: greedy answers equal a transformers float32 decode of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollout_fleet.adapters.tiny_model.build import TinyModelSpec
from tests.refit.conftest import MIN_TOP2_GAP, ROOT, STEPS, greedy_decode
from tests.refit.test_refit_fleet import LOGPROB_TOLERANCE

# GQA (4 heads, 2 KV heads) split over 2 ranks; untied, so lm_head is refit too.
SPEC = TinyModelSpec(vocab_size=512, hidden_size=256, num_heads=4, num_kv_heads=2,
                     num_layers=2, intermediate_size=512)
TRAINERS, TP = 2, 2
WORLD = TRAINERS + TP
BUFFER_BYTES, NUM_BUFFERS = 1 << 20, 2
PROMPTS = 8
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # vLLM's loader cuts these


@pytest.fixture(scope="module")
def sharded_models(tmp_path_factory):
    from rollout_fleet.adapters.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("sharded-models")
    return {seed: build_tiny_model(root / f"seed-{seed}", seed=seed, spec=SPEC) for seed in (0, 1)}


@pytest.fixture(scope="module")
def sharded_reference(sharded_models):
    """Prompts free of near-ties under the new weights (seed 1), and transformers' answers."""
    import random

    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(sharded_models[1], dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts, answers = [], []
    while len(prompts) < PROMPTS:
        prompt = [rng.randrange(3, SPEC.vocab_size) for _ in range(rng.randint(2, 12))]
        tokens, logprobs, gap = greedy_decode(model, prompt)
        if gap > MIN_TOP2_GAP:
            prompts.append(prompt)
            answers.append((tokens, logprobs))
    return prompts, answers


@pytest.fixture(scope="module")
def tp2_sharded_engine(sharded_models):
    from rollout_fleet.adapters.vllm.host import VllmEngine, VllmEngineConfig
    from rollout_fleet.core.refit import RefitProtocol
    from rollout_fleet.ports.contracts.engine import EngineUnderTest

    config = VllmEngineConfig(model=str(sharded_models[0]), tensor_parallel_size=2,
                              refit_protocol=RefitProtocol.SHARDED, max_model_len=256)
    harness = EngineUnderTest.start(lambda: VllmEngine(config), decode=str, prompts=[[5, 6], [7, 8]],
                                    close_engine=lambda engine: engine.close())
    yield harness
    harness.close()


def _trainers(port, model_dir):
    return [subprocess.Popen(
        [sys.executable, "-m", "tests.refit.sharded_trainer_proc", "127.0.0.1", str(port),
         str(WORLD), str(rank), str(TRAINERS), str(BUFFER_BYTES), str(NUM_BUFFERS), "60",
         str(model_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        for rank in range(TRAINERS)]


def _expected_plan(model_dir):
    from safetensors.torch import load_file

    from rollout_fleet.adapters.collective.transfer import refit_info_of
    from rollout_fleet.core.sharded_refit import EngineLayout, TrainerLayout, plan_sharded_refit

    info = refit_info_of(load_file(os.path.join(model_dir, "model.safetensors")))
    layout = TrainerLayout.fsdp(info, TRAINERS, replicated=lambda meta: "norm" in meta.name)
    engine = EngineLayout(1, TP, SPEC.num_heads, SPEC.num_kv_heads, VOCAB_TENSORS)
    return info, plan_sharded_refit(info, layout, engine, BUFFER_BYTES)


def test_two_trainer_ranks_refit_a_tp2_vllm_engine_with_slices_and_it_serves_them_exactly(
        tp2_sharded_engine, sharded_models, sharded_reference):
    from rollout_fleet.adapters.shared import free_port
    from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitProtocol
    from tests.support.processes import stop_child

    harness, engine = tp2_sharded_engine, tp2_sharded_engine.engine
    info, plan = _expected_plan(sharded_models[1])
    port = free_port("127.0.0.1")
    trainers = _trainers(port, sharded_models[1])
    try:
        spec = CollectiveSenderSpec(protocol=RefitProtocol.SHARDED, buffer_bytes=BUFFER_BYTES,
                                    num_buffers=NUM_BUFFERS)
        harness.loop.run(engine.init_collective(GroupJoin(
            host="127.0.0.1", port=port, world_size=WORLD, train_world_size=TRAINERS,
            first_rank=TRAINERS, ranks_per_worker=TP, sender_spec=spec, timeout_s=60,
            backend="gloo")))
        assert harness.loop.run(engine.update_weights(info)) == 1
        sent = [json.loads(t.communicate(timeout=60)[0].strip().splitlines()[-1]) for t in trainers]
    finally:
        for trainer in trainers:
            stop_child(trainer)
    ranks = harness.loop.run(engine.runtime.engine.collective_rpc("rollout_fleet_refit_stats"))
    for g, rank in enumerate(ranks):
        assert rank["received_bytes"] == rank["planned_bytes"] == plan.receiver_bytes[g], rank
        assert rank["fallback_bytes"] == sum(m.nbytes for m in info.tensors
                                             if m.name in VOCAB_TENSORS), rank
        assert rank["received_bytes"] < 0.6 * rank["full_bytes"], rank
    print("per engine rank:", [{k: r[k] for k in ("received_bytes", "fallback_bytes", "full_bytes",
                                                  "sliced_tensors", "whole_tensors")} for r in ranks])
    assert all(sorted(s["fallback"]) == sorted(VOCAB_TENSORS) for s in sent), sent
    assert all(s["sent_bytes"] > 0 for s in sent) and sum(s["sent_bytes"] for s in sent) == sum(
        plan.receiver_bytes), sent
    prompts, answers = sharded_reference
    for prompt, (tokens, logprobs) in zip(prompts, answers):
        served = harness.serve(prompt, max_new_tokens=STEPS)
        assert list(served.token_ids) == tokens, (prompt, served.token_ids, tokens)
        assert list(served.logprobs) == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
