"""A base seed gives every rollout its own seed: a group's samples differ, a rerun repeats."""

from __future__ import annotations

import asyncio

import attrs
import pytest
import torch

from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation
from tests.driver.conftest import collect
from tests.driver.test_generation_loopback import CONFIG
from tests.http.loopback_frontend import SECRET, LoopbackFrontend

GROUP = 8


@pytest.fixture(scope="module")
def server():
    s = LoopbackFrontend()
    yield s
    s.close()


def sampled_group(server, seed, prompts=((3, 4, 5),) * GROUP):
    config = attrs.evolve(CONFIG, seed=seed)
    generation = build_generation(config, frontend_url=server.url, control_secret=SECRET,
                                  workers=[WorkerEndpoint("w0", server.url)])
    data = {"input_ids": torch.tensor(prompts), "input_lengths": torch.tensor([3] * len(prompts))}
    try:
        pairs = asyncio.run(collect(generation, data, greedy=False))
    finally:
        generation.shutdown()
    return [tuple(s["output_ids"][0].tolist()) for _, s in sorted(pairs, key=lambda p: p[0])]


def test_one_prompt_sampled_many_times_gives_different_samples(server):
    assert len(set(sampled_group(server, 7))) > 1


def test_the_same_base_seed_repeats_a_run_and_another_seed_does_not(server):
    first = sampled_group(server, 7)
    assert sampled_group(server, 7) == first
    assert sampled_group(server, 8) != first


def test_a_groups_repeated_prompt_is_one_request_and_each_sample_keeps_its_seed(server):
    sent = len(server.attempt_ids)
    grouped = sampled_group(server, 7)
    assert len(server.attempt_ids) - sent == 1  # the 8 samples of one prompt: one request
    # The same prompt at every other position, another between: no group forms, and the
    # samples at the even positions are numbered (so seeded) as in the group.
    interleaved = sampled_group(server, 7, ((3, 4, 5), (9, 8, 7)) * (GROUP // 2))
    assert len(server.attempt_ids) - sent == 1 + GROUP
    assert interleaved[0::2] == grouped[0::2]
