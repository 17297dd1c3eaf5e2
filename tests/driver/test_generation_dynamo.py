"""FleetGeneration against the REAL Dynamo frontend and two in-memory-engine worker processes."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rollout_fleet.adapters.nemo_rl import GenerationConfig, stack_outputs
from rollout_fleet.core.errors import HttpStatusError, WorkerFailures
from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation
from tests.driver.conftest import PAD, check_sample, collect, engine_answers, mixed_batch
from tests.driver.real_fleet import SERVED_MODEL, start_local_fleet, stop_local_fleet
from tests.driver.test_generation_loopback import run_child

pytestmark = pytest.mark.dynamo
CONFIG = GenerationConfig(model=SERVED_MODEL, max_model_len=64, max_new_tokens=24, max_in_flight=32)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = start_local_fleet(tmp_path_factory.mktemp("driver-fleet"), num_workers=2,
                              token_delay_s=0.002)
    yield fleet
    stop_local_fleet(fleet)


def driver(fleet, config=CONFIG, secret=None):
    return build_generation(config, frontend_url=fleet.frontend_url,
                            control_secret=fleet.secret if secret is None else secret,
                            workers=[WorkerEndpoint(f"w{i}", url)
                                     for i, url in enumerate(fleet.control_urls.values())])


def test_64_mixed_prompts_through_the_real_frontend_are_the_engines_own_answers(fleet):
    generation = driver(fleet)
    try:
        prompts, data = mixed_batch(64, seed=5, max_len=30)
        pairs = asyncio.run(collect(generation, data, greedy=True))
        assert sorted(i for i, _ in pairs) == list(range(64))
        answers = engine_answers(prompts, max_new_tokens=24, max_model_len=64)
        by_index = dict(pairs)
        for index, prompt in enumerate(prompts):
            check_sample(by_index[index], prompt, answers[index])
        batch = stack_outputs([by_index[i] for i in range(64)], pad_token_id=PAD)
        for row, (prompt, answer) in enumerate(zip(prompts, answers)):
            end = len(prompt) + len(answer.token_ids)
            assert batch["output_ids"][row, end:].eq(PAD).all()
            assert batch["logprobs"][row, end:].eq(0).all()
        assert generation.finish_generation() is True
    finally:
        assert generation.shutdown() is True
        assert generation.shutdown() is True


def test_a_pickled_copy_in_another_process_generates_and_invalidates_caches(fleet):
    generation = driver(fleet)
    try:
        prompts, data = mixed_batch(8, seed=21)
        report = run_child(pickle.dumps((generation, data)))
        assert report["is_copy"] and report["invalidated"] is True and report["shutdown"] is True
        answers = engine_answers(prompts, max_new_tokens=24, max_model_len=64)
        assert [i for i, _ in report["samples"]] == list(range(8))
        for (index, sample), prompt, answer in zip(report["samples"], prompts, answers):
            assert sample["output_ids"] == [prompt + list(answer.token_ids)]
            assert sample["logprobs"][0][len(prompt):] == pytest.approx(list(answer.logprobs), abs=1e-6)
        # the copy stopped nothing: the original still generates
        assert len(asyncio.run(collect(generation, data))) == 8
    finally:
        generation.shutdown()


def test_the_workers_refuse_a_flush_with_the_wrong_secret_and_each_is_named(fleet):
    generation = driver(fleet, secret="not-the-secret")
    try:
        with pytest.raises(WorkerFailures) as caught:
            generation.invalidate_kv_cache()
        assert set(caught.value.failures) == {"w0", "w1"}
        assert "control_secret" in str(caught.value)
    finally:
        generation.shutdown()


def test_an_unknown_model_is_a_clear_error_and_the_fleet_keeps_serving(fleet):
    wrong = GenerationConfig(model="no-such-model", max_model_len=64, max_new_tokens=4)
    generation = driver(fleet, wrong)
    try:
        with pytest.raises(HttpStatusError) as caught:
            asyncio.run(collect(generation, mixed_batch(1)[1]))
        assert caught.value.status == 404
    finally:
        generation.shutdown()
    right = driver(fleet)
    try:
        assert len(asyncio.run(collect(right, mixed_batch(3)[1]))) == 3
    finally:
        right.shutdown()


def test_logger_metrics_hold_per_worker_in_flight_timelines_from_prometheus(fleet):
    config = GenerationConfig(model=SERVED_MODEL, max_model_len=64, max_new_tokens=24,
                              max_in_flight=32, metrics_interval_s=0.01)
    generation = driver(fleet, config)
    try:
        generation.prepare_for_generation()
        asyncio.run(collect(generation, mixed_batch(128, seed=2)[1], greedy=False))
        generation.sample_worker_metrics()
        inflight = generation.get_logger_metrics()["inflight_requests"]
        assert set(inflight) == {"w0", "w1"}
        assert all(len(points) >= 1 for points in inflight.values())
        assert max(v for points in inflight.values() for _, v in points) > 0  # load was seen
        generation.clear_logger_metrics()
        assert generation.get_logger_metrics()["inflight_requests"]["w0"] == []
    finally:
        generation.shutdown()


def test_faults_in_front_of_the_real_frontend_are_retried_with_one_request_id(fleet):
    from rollout_fleet.core.retry import RetryPolicy
    from tests.driver.fault_proxy import FaultProxy
    from tests.http.loopback_frontend import Fault

    proxy = FaultProxy(fleet.frontend_url)
    config = GenerationConfig(model=SERVED_MODEL, max_model_len=64, max_new_tokens=24,
                              retry=RetryPolicy(max_attempts=4, base_delay_s=0.01, jitter=0.0))
    generation = build_generation(config, frontend_url=proxy.url, control_secret=fleet.secret,
                                  workers=[])
    try:
        proxy.faults.extend([Fault(503), Fault(429), Fault.connection_reset()])
        prompts, data = mixed_batch(1, seed=4)
        [(index, sample)] = asyncio.run(collect(generation, data))
        check_sample(sample, prompts[0], engine_answers(prompts, max_new_tokens=24, max_model_len=64)[0])
        assert len(proxy.attempt_ids) == 4 and len(set(proxy.attempt_ids)) == 1
        assert proxy.attempt_ids[0].startswith("rollout-")

        proxy.faults.append(Fault(400))
        with pytest.raises(HttpStatusError) as caught:
            asyncio.run(collect(generation, mixed_batch(1, seed=5)[1]))
        assert caught.value.status == 400 and len(proxy.attempt_ids) == 5  # one attempt only
    finally:
        generation.shutdown()
        proxy.close()


def test_1000_concurrent_rollouts_through_the_real_frontend_stay_within_the_socket_limit(fleet):
    from urllib.parse import urlsplit

    from rollout_fleet.adapters.http import HttpSettings
    from tests.driver.sockets import my_connections_to

    frontend_port = urlsplit(fleet.frontend_url).port
    config = GenerationConfig(model=SERVED_MODEL, max_model_len=64, max_new_tokens=8,
                              max_in_flight=1000)
    generation = build_generation(config, frontend_url=fleet.frontend_url, control_secret=fleet.secret,
                                  workers=[], http=HttpSettings(max_in_flight=32))
    peak = 0

    async def run():
        nonlocal peak
        done = asyncio.Event()

        async def watch():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, my_connections_to(frontend_port))
                await asyncio.sleep(0.005)
        watcher = asyncio.ensure_future(watch())
        try:
            return [pair async for pair in generation.generate_async(mixed_batch(1000, seed=8)[1])]
        finally:
            peak = max(peak, my_connections_to(frontend_port))
            done.set()
            await watcher
    try:
        pairs = asyncio.run(run())
        assert sorted(i for i, _ in pairs) == list(range(1000))
        assert peak == 32, f"the pool never filled its 32 connections (peak {peak})"
    finally:
        generation.shutdown()
