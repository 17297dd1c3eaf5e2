"""NeMo-RL's newer generation hooks on the drop-in, called as NeMo-RL's loop calls them, over
in-memory workers: the refit payload mode, the pauses around a refit (new rollouts wait, none
fails), the latest-value metrics drain, the per-step metric window, the settings check, and a
refit deadline: a worker that stalls mid-refit is abandoned by ``refit_timeout_s`` and keeps
serving its previous weights."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rollout_fleet.adapters.memory import (
    EngineCompletionsTransport, LocalWorkerControl, MemoryCollective, MemoryWeightSender,
    TinyBigramModel,
)
from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.adapters.memory.metrics import EngineWorkerMetrics
from rollout_fleet.adapters.nemo_rl import FleetGeneration, GenerationConfig
from rollout_fleet.core.errors import InvalidValue, RefitError, RetriesExhausted
from rollout_fleet.core.refit import CollectiveSenderSpec
from rollout_fleet.core.refit_service import WorkerRefit
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.sleep import WorkerSleep
from rollout_fleet.ports.collective import WeightReceiver
from rollout_fleet.wiring.nemo_rl import DynamoGeneration

STATE_INFO = {"embed.weight": ((48, 8), "float32"), "lm_head.weight": ((48, 8), "float32")}


class StallsMidTransfer(WeightReceiver):
    """A rank's transfer that takes the first tensor and then stalls until ``release``."""

    def __init__(self, inner: WeightReceiver, release: threading.Event) -> None:
        self.spec = inner.spec
        self._inner = inner
        self._release = release

    def receive(self, info):
        tensors = self._inner.receive(info)
        yield next(tensors)
        self._release.wait(30)
        yield from tensors

    def close(self) -> None:
        self._inner.close()


def driver(join_receiver=None, colocated=(), metrics=False):
    engine = MemoryEngine(seed=0, context_length=64, join_receiver=join_receiver)
    control = LocalWorkerControl("worker-0", {**WorkerRefit(engine).controls(),
                                              **WorkerSleep(engine).controls()})
    config = GenerationConfig(model="memory", max_model_len=64, max_new_tokens=6, temperature=0,
                              retry=RetryPolicy(max_attempts=2, base_delay_s=0.0, jitter=0.0),
                              colocated_workers=colocated, metrics_interval_s=0,
                              sender_spec=CollectiveSenderSpec(buffer_bytes=4096, num_buffers=2))
    generation = FleetGeneration(
        config, frontend_url="http://127.0.0.1:1", controls=[control],
        transport=EngineCompletionsTransport(engine, worker_id="worker-0"),
        metrics=[EngineWorkerMetrics("worker-0", engine)] if metrics else ())
    return generation, engine


def batch():
    return {"input_ids": torch.tensor([[3, 4, 5], [7, 8, 0]]), "input_lengths": torch.tensor([3, 2])}


async def collect(generation):
    return {i: s["output_ids"][0].tolist() async for i, s in generation.generate_async(batch())}


def outputs(generation):
    return asyncio.run(collect(generation))


def test_the_refit_payload_is_hugging_face_names():
    generation, _ = driver()
    try:
        assert generation.get_refit_payload_mode() == "hf_export"
    finally:
        generation.shutdown()


@pytest.mark.parametrize("pause, resume", [
    (lambda g: g.pause_generation_for_refit(clear_cache=True), lambda g: g.resume_generation_after_refit()),
    (lambda g: g.pause_generation("retract"), lambda g: g.continue_generation()),
])
def test_a_pause_holds_new_rollouts_until_resumed_and_none_fails(pause, resume):
    generation, engine = driver()
    try:
        before = outputs(generation)
        resets = engine.cache_resets
        pause(generation)
        assert engine.cache_resets == resets + 1  # the cache was cleared at the pause

        async def held_then_released():
            waiting = asyncio.ensure_future(collect(generation))
            await asyncio.sleep(0.2)
            assert not waiting.done() and engine.served_count == served
            await asyncio.to_thread(resume, generation)
            return await asyncio.wait_for(waiting, 10)

        served = engine.served_count
        assert asyncio.run(held_then_released()) == before
    finally:
        generation.shutdown()


def test_an_in_place_pause_keeps_the_cache_and_an_abort_is_refused_by_name():
    generation, engine = driver()
    try:
        resets = engine.cache_resets
        generation.pause_generation("in_place")
        assert engine.cache_resets == resets
        generation.continue_generation()
        with pytest.raises(InvalidValue) as refused:
            generation.pause_generation("abort")
        assert "never aborts those in flight" in str(refused.value)
        assert outputs(generation)  # the refused pause held nothing
    finally:
        generation.shutdown()


def test_the_drain_returns_each_workers_newest_samples_and_drops_the_rest():
    generation, engine = driver(metrics=True)
    try:
        outputs(generation)
        generation.sample_worker_metrics()
        outputs(generation)
        generation.sample_worker_metrics()
        drained = generation.drain_latest_logger_metrics()
        assert [value for _at, value in drained["generated_tokens"]["worker-0"]] == [
            float(engine.generated_tokens)]
        assert generation.get_logger_metrics()["generated_tokens"]["worker-0"] == []
    finally:
        generation.shutdown()


def test_step_metrics_count_the_attempts_retried_since_the_snapshot():
    generation, _ = driver(colocated=("worker-0",))
    try:
        generation.snapshot_step_metrics()
        assert generation.get_step_metrics() == {"retried_attempts": 0.0}
        generation.snapshot_step_metrics()
        generation.finish_generation()  # the only worker sleeps: every attempt is refused
        with pytest.raises(RetriesExhausted):
            outputs(generation)
        step = generation.get_step_metrics()
        assert step["retried_attempts"] >= 1 and step["retried_attempts"] == sum(
            n for cause, n in step.items() if cause.startswith("retried_attempts/"))
    finally:
        generation.shutdown()


def test_settings_are_checked_before_anything_is_built():
    generation = {"backend": "dynamo", "model_name": "memory-model-that-is-not-here",
                  "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": None,
                  "stop_strings": None, "stop_token_ids": None,
                  "vllm_cfg": {"expose_http_server": True}}
    with pytest.raises(InvalidValue):
        DynamoGeneration.validate_settings({"policy": {"generation": generation}})


def test_a_refit_past_its_deadline_is_abandoned_and_the_old_weights_still_serve():
    group, release = MemoryCollective(), threading.Event()
    generation, engine = driver(
        join_receiver=lambda join, rank: StallsMidTransfer(group.join_receiver(join, rank), release))
    try:
        before = outputs(generation)
        for joined in generation.init_collective("127.0.0.1", 1, 2, train_world_size=1):
            joined.result(timeout=10)
        info = generation.prepare_refit_info(STATE_INFO)
        updates = generation.update_weights_from_collective(refit_timeout_s=1.0)
        MemoryWeightSender(group, generation.config.sender_spec).send(
            info, TinyBigramModel.from_seed(7).state_dict().items())
        with pytest.raises(RefitError) as missed:
            updates[0].result(timeout=10)
        assert not release.is_set()  # ended by the deadline: the stalled rank is still stalled
        assert "refit_timeout_s=1 s" in str(missed.value)
        assert "['worker-0'] did not finish" in str(missed.value)
        assert outputs(generation) == before
        assert generation.get_weight_versions() == {"worker-0": 0}
    finally:
        release.set()
        generation.shutdown()


def test_a_bad_deadline_is_refused_before_any_worker_is_asked():
    generation, engine = driver(join_receiver=MemoryCollective().join_receiver)
    try:
        generation.init_collective("127.0.0.1", 1, 2, train_world_size=1)[0].result(timeout=10)
        generation.prepare_refit_info(STATE_INFO)
        with pytest.raises(InvalidValue):
            generation.update_weights_from_collective(refit_timeout_s=0)
        assert engine.weight_version() == 0
    finally:
        generation.shutdown()
