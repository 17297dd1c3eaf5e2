"""Greedy rollouts from the vLLM adapter equal a plain transformers float32 greedy decode.

Prompts are chosen where the decode is free of near-ties (top-2 logprob gap > 1e-3 at every
step, under both weight sets): there, two correct float32 implementations must agree on every
token, and on every logprob within 1e-4.
"""

import pytest

from rollout_fleet.core.errors import WeightMismatch

from .conftest import MODEL_SEED, OTHER_SEED

STEPS = 16
MIN_TOP2_GAP = 1e-3
LOGPROB_TOLERANCE = 1e-4
PROMPTS_WANTED = 6
EOS_TOKEN_ID = 2


def transformers_greedy(model, prompt, steps=STEPS):
    """Tokens, chosen logprobs and the smallest top-2 gap of a full-recompute greedy decode."""
    import torch

    ids = list(prompt)
    tokens, logprobs, gaps = [], [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            row = torch.log_softmax(logits, dim=-1)
            top = torch.topk(row, 2)
            token = int(top.indices[0])
            tokens.append(token)
            logprobs.append(float(top.values[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids.append(token)
            if token == EOS_TOKEN_ID:
                break
    return tokens, logprobs, min(gaps)


@pytest.fixture(scope="module")
def reference(tiny_models, candidate_prompts):
    """seed -> [(prompt, tokens, logprobs)] for the prompts free of near-ties under both seeds."""
    import torch
    from transformers import LlamaForCausalLM

    models = {seed: LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for seed, path in tiny_models.items()}
    chosen = {seed: [] for seed in models}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the vLLM worker holds the other core; two threads would thrash
    try:
        for prompt in candidate_prompts:
            decoded = {seed: transformers_greedy(model, prompt) for seed, model in models.items()}
            if all(gap > MIN_TOP2_GAP for _, _, gap in decoded.values()):
                for seed, (tokens, logprobs, _) in decoded.items():
                    chosen[seed].append((prompt, tokens, logprobs))
            if len(chosen[MODEL_SEED]) == PROMPTS_WANTED:
                break
    finally:
        torch.set_num_threads(threads)
    assert len(chosen[MODEL_SEED]) == PROMPTS_WANTED, "too few prompts free of near-ties"
    return chosen


def assert_matches(vllm_engine, expected):
    for prompt, tokens, logprobs in expected:
        served = vllm_engine.serve(prompt, len(tokens))
        assert list(served.token_ids) == tokens, f"prompt {prompt}"
        assert served.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), f"prompt {prompt}"


def test_greedy_equals_transformers(vllm_engine, reference):
    assert_matches(vllm_engine, reference[MODEL_SEED])


def _refit(vllm_engine, trainer, state, info=None):
    """One refit of ``state`` into the engine over a real gloo group; the new version."""
    import asyncio

    from rollout_fleet.adapters.collective.transfer import refit_info_of

    engine = vllm_engine.engine
    vllm_engine.loop.run(engine.init_collective(trainer.open(engine.refit_ranks())))
    info = info or refit_info_of(state)
    pending = asyncio.run_coroutine_threadsafe(engine.update_weights(info), vllm_engine.loop.loop)
    trainer.send(info, state)
    return pending.result(120)


@pytest.fixture
def trainer():
    from rollout_fleet.core.refit import CollectiveSenderSpec
    from tests.support.trainer import ThreadedTrainer

    trainer = ThreadedTrainer(CollectiveSenderSpec(buffer_bytes=256 << 10), timeout_s=30.0)
    yield trainer
    trainer.close()


def test_other_weights_equal_transformers_of_that_model_and_refitting_back_restores(
        vllm_engine, reference, weights, trainer):
    engine = vllm_engine.engine
    before = [vllm_engine.serve(p, len(t)) for p, t, _ in reference[MODEL_SEED]]
    version = engine.weight_version()
    try:
        assert _refit(vllm_engine, trainer, weights[OTHER_SEED]) == version + 1
        assert_matches(vllm_engine, reference[OTHER_SEED])
        served = vllm_engine.serve(reference[OTHER_SEED][0][0], 4)
        assert served.weight_version == version + 1
        assert served.weight_versions == ((version + 1, 4),)  # vLLM's own per-token labels
    finally:
        assert _refit(vllm_engine, trainer, weights[MODEL_SEED]) == version + 2
    after = [vllm_engine.serve(p, len(t)) for p, t, _ in reference[MODEL_SEED]]
    assert [a.token_ids for a in after] == [b.token_ids for b in before]
    assert [a.logprobs for a in after] == [b.logprobs for b in before], "not restored exactly"


@pytest.mark.parametrize("defect, field", [
    ("name", "tensor name"), ("shape", "shape of 'model.norm.weight'"),
    ("dtype", "dtype of 'model.norm.weight'"), ("missing", "tensor names")])
def test_a_bad_refit_info_is_refused_by_name_and_nothing_changes(vllm_engine, reference, weights,
                                                                defect, field):
    from rollout_fleet.adapters.collective.transfer import refit_info_of
    from rollout_fleet.core.refit import RefitInfo, TensorMeta

    engine, loop = vllm_engine.engine, vllm_engine.loop
    metas = list(refit_info_of(weights[OTHER_SEED]).tensors)
    norm = next(i for i, m in enumerate(metas) if m.name == "model.norm.weight")
    if defect == "name":
        metas.append(TensorMeta("model.norm.weight_typo", metas[norm].shape, "float32"))
    elif defect == "shape":
        metas[norm] = TensorMeta("model.norm.weight", (metas[norm].shape[0] - 1,), "float32")
    elif defect == "dtype":
        metas[norm] = TensorMeta("model.norm.weight", metas[norm].shape, "float16")
    else:
        del metas[norm]
    version = engine.weight_version()
    with pytest.raises(WeightMismatch) as refused:
        loop.run(engine.update_weights(RefitInfo(tuple(metas))))
    assert refused.value.field == field
    assert engine.weight_version() == version
    assert_matches(vllm_engine, reference[MODEL_SEED])
