"""Helpers shared by the driver tests: prompt batches and the engine's own answers."""

from __future__ import annotations

import asyncio
import random

import torch

from rollout_fleet.adapters.memory import MemoryEngine
from rollout_fleet.core.rollout import GREEDY
from rollout_fleet.core.stop_strings import merge_stop_strings

PAD = 47  # a valid token id; padding must never be read as prompt


def mixed_batch(count: int, *, seed: int = 0, max_len: int = 24, vocab: int = 47):
    """``count`` right-padded prompts of lengths 1..max_len, as NeMo-RL hands them over."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((count, width), PAD, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, :len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return prompts, {"input_ids": input_ids, "input_lengths": lengths}


def engine_answers(prompts, *, max_new_tokens, max_model_len, seed=0, sampling=GREEDY,
                   stop_strings=None, configured_stops=()):
    """What a fresh MemoryEngine with the same weights answers, prompt by prompt."""
    engine = MemoryEngine(seed=seed, context_length=max_model_len)

    async def all_of_them():
        answers = []
        for index, prompt in enumerate(prompts):
            stops = merge_stop_strings(configured_stops, stop_strings[index] if stop_strings else None)
            answers.append(await engine.serve_rollout(
                prompt, request_id=f"own-{index}", sampling=sampling, stop_strings=stops,
                max_new_tokens=min(max_new_tokens, max_model_len - len(prompt))))
        return answers
    return asyncio.run(all_of_them())


async def collect(generation, data, greedy=True):
    return [pair async for pair in generation.generate_async(data, greedy=greedy)]


def check_sample(sample, prompt, answer):
    """Every key, dtype, shape and value of one sample of the contract."""
    gen = len(answer.token_ids)
    total = len(prompt) + gen
    assert set(sample) == {"output_ids", "logprobs", "generation_lengths",
                           "unpadded_sequence_lengths", "truncated", "weight_versions"}
    assert sample["output_ids"].dtype == torch.long and sample["output_ids"].shape == (1, total)
    assert sample["logprobs"].dtype == torch.float32 and sample["logprobs"].shape == (1, total)
    assert sample["generation_lengths"].dtype == torch.long and sample["generation_lengths"].shape == (1,)
    assert sample["unpadded_sequence_lengths"].dtype == torch.long
    assert sample["unpadded_sequence_lengths"].shape == (1,)
    assert sample["truncated"].dtype == torch.bool and sample["truncated"].shape == (1,)
    assert sample["output_ids"][0].tolist() == list(prompt) + list(answer.token_ids)
    assert sample["logprobs"][0, :len(prompt)].eq(0).all()
    assert torch.equal(sample["logprobs"][0, len(prompt):],
                       torch.tensor(answer.logprobs, dtype=torch.float32))
    assert sample["generation_lengths"].item() == gen
    assert sample["unpadded_sequence_lengths"].item() == total
    assert sample["truncated"].item() == (answer.finish_reason.value == "length")
    versions = sample["weight_versions"]
    assert versions.dtype == torch.long and versions.shape == (1, total)
    assert versions[0, :len(prompt)].eq(-1).all()
    expected = [v for v, n in answer.weight_versions for _ in range(n)] or [-1] * gen
    assert versions[0, len(prompt):].tolist() == expected
