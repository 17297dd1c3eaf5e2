"""A vLLM worker whose engine core is killed (SIGKILL) mid-batch, in a fleet of 2 on Ray: it
leaves the frontend's routing and the fleet, every rollout comes back exactly once and equal to
the model's greedy answer (those it held are retried on the survivor), the fleet reports it lost,
and the next refit forms its group with the survivor alone, over gloo."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rollout_fleet.core.retry import RetryPolicy
from tests.driver.conftest import collect
from tests.refit.conftest import Trainer
from tests.refit.test_refit_fleet import LOGPROB_TOLERANCE, assert_serves, batch_of, info_of, refit
from tests.support.lost_worker import (
    RoutingProbe, retryable, wait_for_in_flight, wait_until_lost,
)
from tests.support.engine_core import engine_core_of

COPIES = 2  # the 128 reference prompts, twice: 256 rollouts


def test_a_killed_engine_core_loses_no_rollout_and_the_next_refit_uses_the_survivor(
        fleet, models, reference):
    prompts, answers = reference
    batch = [prompt for _ in range(COPIES) for prompt in prompts]
    retry = RetryPolicy(max_attempts=8, base_delay_s=0.1, backoff=1.5, max_delay_s=1.0)
    generation = fleet.generation(retry=retry, max_in_flight=64)
    victim = next(w for w in fleet.workers if w.name == "worker-0")
    core = engine_core_of(victim.pid)
    probe = RoutingProbe(fleet.frontend_url, fleet.config.served_model_name)
    killed: dict = {}

    async def batch_with_the_core_killed():
        async def kill_when_busy():
            killed["in_flight"] = await asyncio.to_thread(wait_for_in_flight, fleet, "worker-0")
            killed["at"], killed["wall"] = time.monotonic(), time.time()
            os.kill(core.pid, signal.SIGKILL)
            probe.start()
            lost = await asyncio.to_thread(wait_until_lost, fleet, "worker-0")
            killed["lost"], killed["lost_after_s"] = lost, time.monotonic() - killed["at"]
        kill = asyncio.ensure_future(kill_when_busy())
        try:
            return await collect(generation, batch_of(batch), greedy=True)
        finally:
            await kill

    try:
        with probe:
            started = time.monotonic()
            pairs = asyncio.run(batch_with_the_core_killed())
            batch_s = time.monotonic() - started
            lost, lost_after_s = killed["lost"], killed["lost_after_s"]
            time.sleep(0.5)  # probes after the worker left
        assert killed["in_flight"] > 0
        assert not core.is_running(), "the engine core outlived its SIGKILL"
        indices = [index for index, _ in pairs]
        assert sorted(indices) == list(range(len(batch))), "a rollout was lost or duplicated"
        for index, sample in pairs:
            prompt = batch[index]
            want_tokens, want_logprobs = answers[0][index % len(prompts)]
            n = int(sample["generation_lengths"][0])
            assert sample["output_ids"][0, len(prompt):len(prompt) + n].tolist() == want_tokens
            assert sample["logprobs"][0, len(prompt):len(prompt) + n].tolist() == pytest.approx(
                want_logprobs, abs=LOGPROB_TOLERANCE)
        assert list(lost) == ["worker-0"] and "engine core died" in lost["worker-0"], lost
        refused = probe.refused_after(killed["at"])
        assert all(retryable(status) for _, status, _ in refused), refused  # never a 400
        assert probe.served_after(killed["at"]) > 0
        print(f"\n{len(batch)} rollouts in {batch_s:.1f} s; worker-0 held {killed['in_flight']}"
              f" at the kill (at {killed['wall']:.3f}); kill -> reported lost {lost_after_s:.2f} s;"
              f" {probe.served_after(killed['at'])} probes served after the kill, refused"
              f" (s after the kill, status, answer): {refused}")

        # The next refit: the survivor alone, world size 1 + 1.
        assert generation.get_inference_world_size() == 1
        trainer = Trainer(generation)
        try:
            generation.prepare_refit_info(info_of(models[1]))
            refit(generation, trainer, models[1])
        finally:
            trainer.close()
        assert generation.get_weight_versions() == {"worker-1": 1}
        assert_serves(generation, reference, 1)
    finally:
        generation.shutdown()
