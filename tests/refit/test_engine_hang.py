"""A vLLM worker whose engine core hangs (SIGSTOP: alive, silent) mid-batch, in a fleet of 2 on
Ray: the worker's watchdog takes its engine for hung after ``hang_timeout_s`` and leaves the
frontend's routing and the fleet; every rollout comes back exactly once and equal to the model's
greedy answer (those it held are retried on the survivor); the fleet reports it lost with the
reason, nothing of its engine is left running, and the next refit forms its group with the
survivor alone, over gloo."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rollout_fleet.core.retry import RetryPolicy
from tests.driver.conftest import collect
from tests.refit.conftest import STEPS, Trainer
from tests.refit.test_refit_fleet import LOGPROB_TOLERANCE, assert_serves, batch_of, info_of, refit
from tests.support.engine_core import engine_core_of
from tests.support.lost_worker import RoutingProbe, retryable, wait_for_in_flight, wait_until_lost

COPIES = 2  # the 128 reference prompts, twice: 256 rollouts
HANG_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    config = parse_config({
        "engine": {"kind": "vllm"}, "model": str(models[0]), "served_model_name": "tiny",
        "num_workers": 2, "max_model_len": 512, "max_new_tokens": STEPS,
        "run_dir": str(tmp_path_factory.mktemp("hang-fleet")),
        "refit": {"buffer_bytes": 1 << 20, "num_buffers": 2},
        "timeouts": {"start_s": 600, "refit_s": 60, "hang_timeout_s": HANG_TIMEOUT_S}})
    fleet = Fleet.start(config)
    yield fleet
    fleet.shutdown()


def test_a_stopped_engine_core_is_found_hung_its_rollouts_finish_elsewhere_and_refit_skips_it(
        fleet, models, reference):
    prompts, answers = reference
    batch = [prompt for _ in range(COPIES) for prompt in prompts]
    retry = RetryPolicy(max_attempts=8, base_delay_s=0.1, backoff=1.5, max_delay_s=1.0)
    generation = fleet.generation(retry=retry, max_in_flight=64)
    victim = next(w for w in fleet.workers if w.name == "worker-0")
    core = engine_core_of(victim.pid)
    probe = RoutingProbe(fleet.frontend_url, fleet.config.served_model_name)
    stopped: dict = {}

    async def batch_with_the_core_stopped():
        async def stop_when_busy():
            stopped["in_flight"] = await asyncio.to_thread(wait_for_in_flight, fleet, "worker-0")
            stopped["at"] = time.monotonic()
            os.kill(core.pid, signal.SIGSTOP)
            probe.start()
            lost = await asyncio.to_thread(wait_until_lost, fleet, "worker-0",
                                           HANG_TIMEOUT_S + 60)
            stopped["lost"], stopped["lost_after_s"] = lost, time.monotonic() - stopped["at"]
        stop = asyncio.ensure_future(stop_when_busy())
        try:
            return await collect(generation, batch_of(batch), greedy=True)
        finally:
            await stop

    try:
        with probe:
            started = time.monotonic()
            pairs = asyncio.run(batch_with_the_core_stopped())
            batch_s = time.monotonic() - started
            time.sleep(0.5)  # probes after the worker left
        assert stopped["in_flight"] > 0
        indices = [index for index, _ in pairs]
        assert sorted(indices) == list(range(len(batch))), "a rollout was lost or duplicated"
        for index, sample in pairs:
            prompt = batch[index]
            want_tokens, want_logprobs = answers[0][index % len(prompts)]
            n = int(sample["generation_lengths"][0])
            assert sample["output_ids"][0, len(prompt):len(prompt) + n].tolist() == want_tokens
            assert sample["logprobs"][0, len(prompt):len(prompt) + n].tolist() == pytest.approx(
                want_logprobs, abs=LOGPROB_TOLERANCE)
        lost = stopped["lost"]
        assert list(lost) == ["worker-0"], lost
        assert lost["worker-0"].startswith("EngineHung: engine hung: no step completed"), lost
        refused = probe.refused_after(stopped["at"])
        assert all(retryable(status) for _, status, _ in refused), refused  # never a 400
        assert probe.served_after(stopped["at"]) > 0
        deadline = time.monotonic() + 30
        while core.is_running() and core.status() != "zombie" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not core.is_running() or core.status() == "zombie", "the stopped core was left"
        print(f"\n{len(batch)} rollouts in {batch_s:.1f} s; worker-0 held {stopped['in_flight']}"
              f" at the SIGSTOP; reported lost {stopped['lost_after_s']:.2f} s after it "
              f"(hang_timeout_s={HANG_TIMEOUT_S:g})")

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
