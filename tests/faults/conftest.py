"""Fault and trust tests: a simulated fleet (memory-engine workers + the real Dynamo frontend,
plain child processes) per test, real processes killed or paused, a real proxy in the path."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.wiring.simfleet import SimFleet
from tests.driver.conftest import check_sample, engine_answers, mixed_batch
from tests.support import leftover_processes

SEED = 0


@pytest.fixture
def start_fleet(tmp_path):
    """``start_fleet(workers=2, token_delay_s=...)`` -> a started SimFleet, stopped afterwards
    and checked: nothing of it left running."""
    started: list[SimFleet] = []

    def start(**options) -> SimFleet:
        options.setdefault("workers", 2)
        options.setdefault("seed", SEED)
        fleet = SimFleet(tmp_path / f"fleet-{len(started)}", **options)
        started.append(fleet)
        return fleet.start()

    yield start
    groups = [g for fleet in started for g in fleet.process_groups()]
    for fleet in started:
        fleet.stop()
    left = leftover_processes(groups, wait_s=10)
    assert left == [], f"processes of the simulated fleet left behind: {left}"


def check_batch_exactly_once(pairs, prompts, *, max_new_tokens, max_model_len):
    """Every sample index exactly once, each equal to the engine's own greedy answer."""
    indices = [index for index, _ in pairs]
    assert sorted(indices) == list(range(len(prompts))), (
        f"lost: {sorted(set(range(len(prompts))) - set(indices))}, "
        f"duplicated: {sorted({i for i in indices if indices.count(i) > 1})}")
    answers = engine_answers(prompts, max_new_tokens=max_new_tokens, max_model_len=max_model_len,
                             seed=SEED)
    for index, sample in pairs:
        check_sample(sample, prompts[index], answers[index])


async def collect_until_error(generation, data, greedy=True):
    """(pairs yielded so far, the error that ended the batch or None)."""
    pairs = []
    try:
        async for pair in generation.generate_async(data, greedy=greedy):
            pairs.append(pair)
    except Exception as exc:  # noqa: BLE001 - returned for the test to judge
        return pairs, exc
    return pairs, None


def run(coro):
    return asyncio.run(coro)


__all__ = ["check_batch_exactly_once", "collect_until_error", "mixed_batch", "run"]
