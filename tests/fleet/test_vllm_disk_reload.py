"""A fleet of two real vLLM workers (Ray, the real frontend) takes a refit from a checkpoint
folder through the driver's ``reload_weights``: each worker's own control table checks the
folder and reloads it with vLLM's loader. A folder with a tensor missing is refused by every
worker, named, before any of them pauses: versions and answers stay. A whole one is loaded by
both at the fleet's next version, and the rollouts through the frontend then equal
transformers' greedy decode of those weights; reloading the first folder restores the first
answers."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from rollout_fleet.core.errors import WorkerFailures
from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.dynamo]
STEPS = 12
CANDIDATES = [[5, 17, 80], [200, 31], [44, 45, 46, 47], [300], [61, 62], [120, 7, 9], [250, 251]]
MIN_TOP2_GAP = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rollout_fleet.adapters.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("disk-reload-models")
    return {seed: build_tiny_model(root / f"seed-{seed}", seed=seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, models):
    before = own_children_before()
    fleet = Fleet.start(parse_config({
        "engine": {"kind": "vllm"}, "model": str(models[0]), "num_workers": 2,
        "max_model_len": 512, "run_dir": str(tmp_path_factory.mktemp("disk-reload") / "run"),
        "timeouts": {"start_s": 400}}))
    pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
    ports = fleet_ports(fleet)
    try:
        yield fleet
    finally:
        fleet.shutdown()
    assert_nothing_left(pgids, ports, before)


def transformers_greedy(folder, prompts):
    """prompt index -> greedy tokens (a full recompute per step, EOS included), for the
    prompts free of near-ties."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    chosen = {}
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            ids, gaps = list(prompt), []
            for _ in range(STEPS):
                top = torch.topk(torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1), 2)
                gaps.append(float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
                if ids[-1] == 2:
                    break
            if min(gaps) > MIN_TOP2_GAP:
                chosen[index] = ids[len(prompt):]
    return chosen


def greedy(generation, prompts):
    """prompt index -> (tokens, their weight versions) through the fleet."""
    import torch

    width = max(len(p) for p in prompts)
    data = {"input_ids": torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
            "input_lengths": torch.tensor([len(p) for p in prompts])}

    async def run():
        return [pair async for pair in generation.generate_async(data, greedy=True)]

    out = {}
    for index, sample in asyncio.run(run()):
        start, length = len(prompts[index]), int(sample["generation_lengths"][0])
        out[index] = (sample["output_ids"][0, start:start + length].tolist(),
                      set(sample["weight_versions"][0, start:start + length].tolist()))
    return out


def test_every_worker_checks_then_reloads_the_folder(fleet, models, tmp_path):
    generation = fleet.generation(max_new_tokens=STEPS)
    try:
        check_then_reload(generation, set(fleet.control_urls), models, tmp_path)
    finally:
        generation.shutdown()


def check_then_reload(generation, workers, models, tmp_path):
    from safetensors.torch import load_file, save_file

    before = greedy(generation, CANDIDATES)
    assert all(versions == {0} for _, versions in before.values())

    lacking = shutil.copytree(models[1], tmp_path / "lacking")
    state = load_file(str(lacking / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(lacking / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WorkerFailures) as refused:
        generation.reload_weights(str(lacking))
    assert refused.value.step == "check_checkpoint" and set(refused.value.failures) == workers
    assert "model.norm.weight" in str(refused.value)
    assert set(generation.get_weight_versions().values()) == {0}
    assert greedy(generation, CANDIDATES) == before

    assert generation.reload_weights(str(models[1])) == {w: 1 for w in workers}
    expected = transformers_greedy(models[1], CANDIDATES)
    assert len(expected) >= 3, "too few prompts free of near-ties"
    served = greedy(generation, CANDIDATES)
    assert {i: served[i][0] for i in expected} == expected
    assert all(versions == {1} for _, versions in served.values())

    assert generation.reload_weights(str(models[0]), refit_timeout_s=120) == {w: 2 for w in workers}
    assert {i: t for i, (t, _) in greedy(generation, CANDIDATES).items()} == {
        i: t for i, (t, _) in before.items()}
