"""The driver's colocated phases over in-memory workers: ``finish_generation`` flushes every
cache and sleeps the colocated workers only; a batch asked of a sleeping fleet fails with the
worker's own message once its retries give up; ``prepare_for_generation`` wakes them (in two
steps, as NeMo-RL's colocated refit asks: weights, then KV cache) and they answer as before."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout_fleet.adapters.memory import EngineCompletionsTransport, LocalWorkerControl
from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.adapters.nemo_rl import FleetGeneration, GenerationConfig
from rollout_fleet.core.errors import RetriesExhausted
from rollout_fleet.core.refit_service import WorkerRefit
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.sleep import WorkerSleep


def driver(colocated=("worker-0",), level=1):
    engines = [MemoryEngine(seed=0, context_length=64) for _ in range(2)]
    controls = [LocalWorkerControl(f"worker-{i}", {**WorkerRefit(e).controls(),
                                                   **WorkerSleep(e).controls()})
                for i, e in enumerate(engines)]
    config = GenerationConfig(model="memory", max_model_len=64, max_new_tokens=6, temperature=0,
                              retry=RetryPolicy(max_attempts=2, base_delay_s=0.0, jitter=0.0),
                              colocated_workers=colocated, sleep_level=level)
    transport = EngineCompletionsTransport(engines[0], worker_id="worker-0")
    return FleetGeneration(config, frontend_url="http://127.0.0.1:1", transport=transport,
                            controls=controls), engines


def batch():
    return {"input_ids": torch.tensor([[3, 4, 5], [7, 8, 0]]), "input_lengths": torch.tensor([3, 2])}


def outputs(generation):
    async def collect():
        return {i: s["output_ids"][0].tolist() async for i, s in generation.generate_async(batch())}
    return asyncio.run(collect())


def test_finish_sleeps_the_colocated_workers_and_prepare_wakes_them():
    generation, engines = driver()
    try:
        before = outputs(generation)
        resets = [e.cache_resets for e in engines]
        assert generation.finish_generation() is True
        assert [e.cache_resets for e in engines] == [r + 1 for r in resets]  # every cache flushed
        assert engines[0].is_sleeping() and not engines[1].is_sleeping()  # colocated only
        with pytest.raises(RetriesExhausted) as gave_up:
            outputs(generation)
        assert "HTTP 503: worker worker-0 is asleep (level 1); the trainer wakes it with " \
               "prepare_for_generation / rollout-fleet wake" in str(gave_up.value)
        assert generation.prepare_for_generation(tags=["weights"]) is True
        assert engines[0].sleep_state().asleep == frozenset({"kv_cache"})
        assert generation.prepare_for_generation(tags=["kv_cache"]) is True
        assert generation.sleep_states()["worker-0"].serving
        assert outputs(generation) == before
    finally:
        generation.shutdown()


def test_finish_without_releasing_the_gpu_keeps_them_awake():
    generation, engines = driver()
    try:
        generation.finish_generation(release_gpu=False)
        assert not engines[0].is_sleeping()
        assert generation.prepare_for_generation() is True  # awake already: nothing changes
    finally:
        generation.shutdown()


def test_after_a_level_2_sleep_prepare_says_a_refit_must_come_first():
    generation, engines = driver(level=2)
    try:
        generation.finish_generation()
        assert engines[0].sleep_state().weights_lost
        assert generation.prepare_for_generation() is False
    finally:
        generation.shutdown()


def test_a_fleet_without_colocation_never_sleeps():
    generation, engines = driver(colocated=())
    try:
        generation.finish_generation()
        assert not any(e.is_sleeping() for e in engines)
    finally:
        generation.shutdown()
