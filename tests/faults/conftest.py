"""Fault and trust tests: a fleet of memory-engine workers placed as local processes behind
the real Dynamo frontend, per test; real processes killed or paused, a real proxy in the path."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet
from tests.driver.conftest import check_sample, engine_answers, mixed_batch
from tests.support import leftover_processes

SEED = 0
CONTEXT_LENGTH = 256


def local_memory_config(run_dir, *, workers: int = 2, token_delay_s: float = 0.0,
                        router: str = "round-robin", env: dict | None = None, **more):
    """A fleet of ``workers`` memory engines placed as child processes of this one (``more``:
    other config keys)."""
    timeouts = {"start_s": 180, **more.pop("timeouts", {})}
    return parse_config({**more,
        "placement": "local", "num_workers": workers, "served_model_name": "mem",
        "engine": {"kind": "memory", "seed": SEED, "context_length": CONTEXT_LENGTH,
                   "token_delay_s": token_delay_s, "test_controls": True},
        "max_model_len": CONTEXT_LENGTH, "max_new_tokens": 16, "router": router,
        "env": env or {}, "run_dir": str(run_dir), "timeouts": timeouts})


@pytest.fixture
def start_fleet(tmp_path):
    """``start_fleet(workers=2, token_delay_s=...)`` -> a started local fleet, stopped
    afterwards and checked: nothing of it left running."""
    started: list[Fleet] = []

    def start(**options) -> Fleet:
        fleet = Fleet.start(local_memory_config(tmp_path / f"fleet-{len(started)}", **options))
        started.append(fleet)
        return fleet

    yield start
    groups = [g for fleet in started for g in fleet.process_groups()]
    for fleet in started:
        fleet.shutdown()
    left = leftover_processes(groups, wait_s=10)
    assert left == [], f"processes of the fleet left behind: {left}"


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
