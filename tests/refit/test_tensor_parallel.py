"""A vLLM worker with tensor_parallel_size = 2 on the CPU (one core per rank): both engine ranks
join the refit group and receive inside vLLM's workers; greedy answers equal transformers after
alternating refits; the Dynamo host process holds nothing model-sized through a ~200 MiB refit."""

from __future__ import annotations

import contextlib
import threading

import pytest

from rollout_fleet.adapters.tiny_model.build import TinyModelSpec
from tests.refit.conftest import STEPS, Trainer, greedy_decode
from tests.refit.test_refit_fleet import assert_serves, info_of, refit
from tests.support.engine_core import model_workers_of

# ~202 MiB of float32 weights; heads and KV heads split evenly over 2 ranks.
SPEC = TinyModelSpec(vocab_size=1024, hidden_size=1024, num_heads=8, num_kv_heads=4,
                     num_layers=3, intermediate_size=4608)
PROMPTS = 6


@pytest.fixture(scope="module")
def big_models(tmp_path_factory):
    from rollout_fleet.adapters.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tp-models")
    return {seed: build_tiny_model(root / f"seed-{seed}", seed=seed, spec=SPEC) for seed in (0, 1)}


@pytest.fixture(scope="module")
def big_reference(big_models):
    """(prompts, {seed: [(tokens, logprobs)]}) from transformers, prompts free of near-ties."""
    import random

    import torch
    from transformers import LlamaForCausalLM

    from tests.refit.conftest import MIN_TOP2_GAP

    loaded = {s: LlamaForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for s, p in big_models.items()}
    rng = random.Random(11)
    prompts, answers = [], {s: [] for s in loaded}
    while len(prompts) < PROMPTS:
        prompt = [rng.randrange(3, SPEC.vocab_size) for _ in range(rng.randint(2, 12))]
        decoded = {s: greedy_decode(m, prompt) for s, m in loaded.items()}
        if all(gap > MIN_TOP2_GAP for _, _, gap in decoded.values()):
            prompts.append(prompt)
            for s in loaded:
                answers[s].append(decoded[s][:2])
    return prompts, answers


@pytest.fixture(scope="module")
def tp_fleet(big_models, tmp_path_factory):
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet
    from tests.support.net import in_private_netns

    if not in_private_netns():
        pytest.fail("the refit tier starts a local Ray cluster: run it through scripts/test.sh")
    config = parse_config({
        "engine": {"kind": "vllm", "tensor_parallel_size": 2}, "ranks_per_worker": 2,
        "model": str(big_models[0]), "served_model_name": "tiny", "num_workers": 1,
        "max_model_len": 512, "max_new_tokens": STEPS, "cpus_per_worker": 2,
        "run_dir": str(tmp_path_factory.mktemp("tp-fleet")),
        "refit": {"buffer_bytes": 32 << 20, "num_buffers": 2},
        "timeouts": {"start_s": 600, "refit_s": 120}})
    fleet = Fleet.start(config)
    yield fleet
    fleet.shutdown()


@pytest.fixture
def generation(tp_fleet):
    generation = tp_fleet.generation()
    yield generation
    generation.shutdown()


def test_both_ranks_of_the_worker_run_in_vllm_and_join_the_group(tp_fleet, generation):
    (worker,) = tp_fleet.workers
    ranks = model_workers_of(worker.pid)
    assert len(ranks) == 2, ranks
    assert generation.get_inference_world_size() == 2


def test_three_alternating_refits_equal_transformers_and_the_host_stays_small(
        tp_fleet, generation, big_models, big_reference):
    import psutil

    (worker,) = tp_fleet.workers
    host = psutil.Process(worker.pid)  # the Dynamo host process (vLLM's processes are its children)
    model_bytes = sum(m.nbytes for m in _metas(big_models[1]))
    assert_serves(generation, big_reference, 0, count=PROMPTS)
    trainer = Trainer(generation, timeout_s=120)
    try:
        generation.prepare_refit_info(info_of(big_models[1]))
        rss_before, peaks = host.memory_info().rss, []
        for round_, seed in enumerate((1, 0, 1), start=1):
            with _peak_rss(host) as peak:  # sampled during the refit, not only after it
                refit(generation, trainer, big_models[seed])
            peaks.append(peak["rss"])
            assert_serves(generation, big_reference, seed, count=PROMPTS)
            assert set(generation.get_weight_versions().values()) == {round_}
        growth = max(peaks) - rss_before
        assert growth < 0.1 * model_bytes, (
            f"the host process grew by {growth / 2**20:.1f} MiB over a refit of"
            f" {model_bytes / 2**20:.0f} MiB")
    finally:
        trainer.close()


@contextlib.contextmanager
def _peak_rss(process, every_s=0.02):
    peak = {"rss": process.memory_info().rss}
    done = threading.Event()

    def sample():
        while not done.wait(every_s):
            peak["rss"] = max(peak["rss"], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


def _metas(model_dir):
    from rollout_fleet.adapters.vllm.host.weights import checkpoint_metas

    return checkpoint_metas(model_dir, "float32").values()
