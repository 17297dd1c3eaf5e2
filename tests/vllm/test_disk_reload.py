"""A refit from a checkpoint folder through vLLM's own reload (the disk reload port of the vLLM
engine), on the session's real engine.

A folder written by transformers' ``save_pretrained`` (new random weights, sharded with an
index) is reloaded in keep mode: greedy answers then equal transformers' on those weights, the
version is one more, and a rollout in flight across the reload continues on the new weights
(its tokens labelled with both versions). A truncated file, a missing tensor, a wrong shape or
dtype, a staging folder: each refused naming the file or tensor, the old answers unchanged. A
deadline passed before loading leaves the old weights; a load that breaks inside vLLM half way
is rolled back from the previous folder. Every test puts the session's weights back.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from rollout_fleet.core.errors import IncompleteCheckpoint, RefitError, WeightMismatch
from rollout_fleet.ports.contracts.harness import GREEDY

from .conftest import MODEL_SEED, OTHER_SEED
from .test_vllm_matches_transformers import MIN_TOP2_GAP, assert_matches, transformers_greedy

PROMPTS_WANTED = 4
SHARD_SIZE = "1MB"  # the tiny model's 1.8 MB in two files and an index


@pytest.fixture(scope="module")
def new_model(tiny_models, tmp_path_factory):
    """(folder, transformers model): the tiny model's architecture with new random weights,
    written by ``save_pretrained`` in shards."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_models[MODEL_SEED], dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2024)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.08)
            else:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    folder = tmp_path_factory.mktemp("disk-reload") / "step-1"
    model.save_pretrained(folder, max_shard_size=SHARD_SIZE)
    assert len(list(folder.glob("*.safetensors"))) == 2
    return folder, model


@pytest.fixture(scope="module")
def new_reference(new_model, candidate_prompts):
    """[(prompt, tokens, logprobs)] of transformers' greedy decode on the new weights, for
    prompts free of near-ties."""
    import torch

    _, model = new_model
    chosen = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the vLLM worker holds the other core
    try:
        for prompt in candidate_prompts:
            tokens, logprobs, gap = transformers_greedy(model, prompt)
            if gap > MIN_TOP2_GAP:
                chosen.append((prompt, tokens, logprobs))
            if len(chosen) == PROMPTS_WANTED:
                break
    finally:
        torch.set_num_threads(threads)
    assert len(chosen) == PROMPTS_WANTED, "too few prompts free of near-ties"
    return chosen


@pytest.fixture
def restored(vllm_engine, tiny_models):
    """The session's answers before the test; its weights reloaded after it (greedy answers
    exactly as before)."""
    engine, loop = vllm_engine.engine, vllm_engine.loop
    before = vllm_engine.greedy_answers(8)
    yield before
    if engine.weight_version() != 0 or engine.runtime.standing.health.torn:
        loop.run(engine.reload_from_disk(str(tiny_models[MODEL_SEED])))
    assert vllm_engine.greedy_answers(8) == before


def test_a_saved_checkpoint_reloads_in_keep_mode_and_answers_as_transformers(
        vllm_engine, new_model, new_reference, restored):
    engine, loop = vllm_engine.engine, vllm_engine.loop
    folder, _ = new_model
    summary = loop.run(engine.check_checkpoint(str(folder)))
    assert summary.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    version = engine.weight_version()
    assert loop.run(engine.reload_from_disk(str(folder))) == version + 1
    assert engine.weight_version() == version + 1
    assert_matches(vllm_engine, new_reference)
    served = vllm_engine.serve(new_reference[0][0], 4)
    assert served.weight_versions == ((version + 1, 4),)


def test_a_rollout_in_flight_continues_on_the_reloaded_weights(vllm_engine, new_model, restored):
    """Keep mode: the rollout freezes during the reload and goes on after; its first tokens
    are the old weights', labelled with the old version, the rest with the new one."""
    engine, loop = vllm_engine.engine, vllm_engine.loop
    folder, _ = new_model
    prompt, length = list(vllm_engine.prompts[0]), 300
    old = vllm_engine.serve_offered(prompt, length, extra_sampling={"ignore_eos": True}).token_ids
    version = engine.weight_version()

    async def across_the_reload():
        rollout = asyncio.ensure_future(engine.serve_rollout(
            prompt, request_id=vllm_engine.next_id(), max_new_tokens=length, sampling=GREEDY,
            extra_sampling={"ignore_eos": True}))
        started = engine.progress()
        while engine.progress() < started + 8:  # a few steps generated on the old weights
            await asyncio.sleep(0.001)
        reloaded = await engine.reload_from_disk(str(folder))
        return await rollout, reloaded

    served, reloaded = loop.run(across_the_reload())
    assert reloaded == version + 1
    (old_version, before), (new_version, after) = served.weight_versions
    assert (old_version, new_version) == (version, version + 1) and before + after == length
    assert served.token_ids[:before] == old[:before]
    assert served.token_ids != old  # the rest came from the new weights


def _copy(source, target):
    shutil.copytree(source, target)
    return target


def _rewrite(folder, change):
    """The folder's model.safetensors with ``change(state)`` applied."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _truncated(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _without_norm(state):
    del state["model.norm.weight"]


def _short_norm(state):
    state["model.norm.weight"] = state["model.norm.weight"][:-1].contiguous()


def _integer_norm(state):
    import torch

    state["model.norm.weight"] = state["model.norm.weight"].to(dtype=torch.int64)


@pytest.mark.parametrize("defect, error, field, named", [
    ("truncated", IncompleteCheckpoint, "checkpoint file", "model.safetensors"),
    ("missing", WeightMismatch, "tensor names", "model.norm.weight"),
    ("shape", WeightMismatch, "shape of 'model.norm.weight'", "model.safetensors"),
    ("dtype", WeightMismatch, "dtype of 'model.norm.weight'", "int64"),
    ("staging", IncompleteCheckpoint, "checkpoint", ".tmp"),
])
def test_a_bad_checkpoint_is_refused_by_name_and_the_old_weights_serve(
        vllm_engine, tiny_models, tmp_path, restored, defect, error, field, named):
    engine, loop = vllm_engine.engine, vllm_engine.loop
    folder = _copy(tiny_models[OTHER_SEED], tmp_path / ("export.tmp" if defect == "staging"
                                                            else "export"))
    if defect == "truncated":
        _truncated(folder)
    elif defect != "staging":
        _rewrite(folder, {"missing": _without_norm, "shape": _short_norm,
                          "dtype": _integer_norm}[defect])
    version = engine.weight_version()
    with pytest.raises(error) as refused:
        loop.run(engine.reload_from_disk(str(folder)))
    assert refused.value.field == field
    assert named in str(refused.value)
    assert engine.weight_version() == version
    assert not engine.runtime.standing.health.torn
    assert vllm_engine.greedy_answers(8) == restored


def test_a_deadline_passed_before_loading_leaves_the_old_weights(
        vllm_engine, new_model, restored):
    """The reload waits for the weight change before it (a refit under way holds the weight
    lock) past its deadline: abandoned, nothing loaded."""
    engine, loop = vllm_engine.engine, vllm_engine.loop
    folder, _ = new_model
    version = engine.weight_version()

    async def behind_another_change():
        async with engine.runtime.weight_lock:
            return await asyncio.gather(engine.reload_from_disk(str(folder), deadline_s=0.5),
                                        return_exceptions=True)

    (outcome,) = loop.run(behind_another_change())
    assert isinstance(outcome, RefitError) and "deadline of 0.5 s" in str(outcome), outcome
    assert engine.weight_version() == version
    assert not engine.runtime.standing.health.torn
    assert vllm_engine.greedy_answers(8) == restored


def test_a_load_that_breaks_half_way_inside_vllm_is_rolled_back(
        vllm_engine, new_model, tmp_path, restored):
    """The folder checks whole, but vLLM is handed one whose second shard is cut (as if it
    changed under the reload): the first shard's layers load, the second's read fails. The
    previous folder is loaded again: the old answers, the old version, not torn."""
    engine, loop = vllm_engine.engine, vllm_engine.loop
    folder, _ = new_model
    start = str(engine.runtime.engine.model_config.model)
    loop.run(engine.reload_from_disk(start))  # the weights now come from a known folder
    broken = _copy(folder, tmp_path / "broken")
    second = broken / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-4096])
    llm = engine.runtime.engine
    rpc = llm.collective_rpc

    async def swapped(method, timeout=None, args=(), kwargs=None):
        if method == "reload_weights" and kwargs["weights_path"] == str(folder):
            kwargs = {**kwargs, "weights_path": str(broken)}
        return await rpc(method, timeout, args, kwargs)

    version = engine.weight_version()
    llm.collective_rpc = swapped
    try:
        with pytest.raises(RefitError, match="incomplete metadata.*; rolled back: the previous"
                           " weights"):
            loop.run(engine.reload_from_disk(str(folder)))
    finally:
        del llm.collective_rpc
    assert engine.weight_version() == version
    assert not engine.runtime.standing.health.torn
    assert vllm_engine.greedy_answers(8) == restored
