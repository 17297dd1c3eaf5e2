"""FleetGeneration over a real HTTP hop to a loopback server that answers like a Dynamo frontend
(and worker system port) with the in-memory engine."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_fleet.adapters.nemo_rl import GenerationConfig, stack_outputs
from rollout_fleet.core.errors import (
    ContextLimitExceeded, HttpStatusError, InvalidValue, RolloutFleetError, WorkerFailures,
)
from rollout_fleet.core.refit import CollectiveSenderSpec
from rollout_fleet.core.rollout import SamplingSpec
from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation
from tests.driver.conftest import PAD, check_sample, collect, engine_answers, mixed_batch
from tests.http.loopback_frontend import MODEL, SECRET, LoopbackFrontend

ROOT = Path(__file__).resolve().parents[2]
CONFIG = GenerationConfig(model=MODEL, max_model_len=48, max_new_tokens=16, max_in_flight=16)


class Fleetish:
    """Stands in for what a driver may own; counts how often it was stopped."""

    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


@pytest.fixture(scope="module")
def server():
    s = LoopbackFrontend()
    yield s
    s.close()


@pytest.fixture
def generation(server):
    owned = Fleetish()
    g = build_generation(CONFIG, frontend_url=server.url, control_secret=SECRET, owned=[owned],
                         workers=[WorkerEndpoint("w0", server.url), WorkerEndpoint("w1", server.url)])
    g.owned_for_test = owned
    yield g
    g.shutdown()


def test_64_mixed_prompts_come_back_as_the_engines_own_answers_in_the_contracts_tensors(generation):
    prompts, data = mixed_batch(64)
    pairs = asyncio.run(collect(generation, data, greedy=True))
    assert sorted(i for i, _ in pairs) == list(range(64))
    answers = engine_answers(prompts, max_new_tokens=16, max_model_len=48)
    by_index = dict(pairs)
    for index, prompt in enumerate(prompts):
        check_sample(by_index[index], prompt, answers[index])
    assert any(a.finish_reason.value == "length" for a in answers)

    batch = stack_outputs([by_index[i] for i in range(64)], pad_token_id=PAD)
    width = max(len(p) + len(a.token_ids) for p, a in zip(prompts, answers))
    assert batch["output_ids"].shape == (64, width) and batch["logprobs"].shape == (64, width)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        end = len(prompt) + len(answer.token_ids)
        assert batch["output_ids"][row, end:].eq(PAD).all()
        assert batch["logprobs"][row, end:].eq(0).all()
        assert batch["output_ids"][row, :end].tolist() == prompt + list(answer.token_ids)


def test_sampling_with_a_seed_and_per_sample_stop_strings_match_the_engine(server):
    config = GenerationConfig(model=MODEL, max_model_len=48, max_new_tokens=16, seed=1234,
                              temperature=0.9, top_p=0.95, stop_strings=["e"])
    g = build_generation(config, frontend_url=server.url, control_secret=SECRET, workers=[])
    try:
        prompts, data = mixed_batch(8, seed=3)
        stops = [["th"], None, ["a", "o"], None, [], ["x"], None, ["in"]]
        data["stop_strings"] = stops
        pairs = dict(asyncio.run(collect(g, data, greedy=False)))
        for index, prompt in enumerate(prompts):  # rollout n samples with the base seed + n
            (answer,) = engine_answers([prompt], max_new_tokens=16, max_model_len=48,
                                       stop_strings=[stops[index]], configured_stops=["e"],
                                       sampling=SamplingSpec(greedy=False, temperature=0.9,
                                                             top_p=0.95, seed=1234 + index))
            check_sample(pairs[index], prompt, answer)
    finally:
        g.shutdown()


def test_a_dict_subclass_batch_comes_back_in_its_own_type(generation):
    class BatchedDataDict(dict):
        pass
    prompts, data = mixed_batch(3)
    pairs = asyncio.run(collect(generation, BatchedDataDict(data)))
    assert all(type(sample) is BatchedDataDict for _, sample in pairs)


def test_concurrency_reaches_the_configured_limit_and_never_passes_it():
    slow = LoopbackFrontend(delay_s=0.1)  # slow enough that every slot fills before one frees
    config = GenerationConfig(model=MODEL, max_model_len=48, max_new_tokens=4, max_in_flight=5)
    g = build_generation(config, frontend_url=slow.url, control_secret=SECRET, workers=[])
    try:
        _, data = mixed_batch(40)
        assert len(asyncio.run(collect(g, data))) == 40
        assert slow.peak_active == 5
        assert len(slow.peers) == 5
    finally:
        g.shutdown()
        slow.close()


def test_a_consumer_that_stops_early_cancels_the_rest_and_the_driver_still_serves(generation):
    _, data = mixed_batch(32)

    async def first_two():
        out = []
        stream = generation.generate_async(data)
        async for pair in stream:
            out.append(pair)
            if len(out) == 2:
                break
        await stream.aclose()
        return out
    assert len(asyncio.run(first_two())) == 2
    assert len(asyncio.run(collect(generation, data))) == 32


def test_a_prompt_that_fills_the_context_is_refused_before_anything_is_sent(generation, server):
    sent_before = len(server.attempt_ids)
    data = {"input_ids": torch.ones((2, 48), dtype=torch.long),
            "input_lengths": torch.tensor([3, 48])}
    with pytest.raises(ContextLimitExceeded, match=r"sample 1: prompt_len=48"):
        asyncio.run(collect(generation, data))
    assert len(server.attempt_ids) == sent_before


@pytest.mark.parametrize("data,field", [
    ({"input_ids": torch.ones((2, 4)), "input_lengths": torch.tensor([1, 2])}, "input_ids"),
    ({"input_ids": torch.ones((2, 4), dtype=torch.long), "input_lengths": torch.tensor([1, 5])},
     r"input_lengths\[1\]"),
    ({"input_ids": torch.ones((2, 4), dtype=torch.long), "input_lengths": torch.tensor([1])},
     "input_lengths"),
    ({"input_ids": torch.ones((2, 4), dtype=torch.long)}, "input_lengths"),
    ({"input_ids": torch.ones((2, 4), dtype=torch.long), "input_lengths": torch.tensor([1, 2]),
      "stop_strings": ["a"]}, "stop_strings"),
    ({"input_ids": torch.tensor([[3, 4, 0], [5, 6, -7]]), "input_lengths": torch.tensor([2, 3])},
     r"^input_ids\[1, 2\]=-7: token IDs are non-negative ints$"),
    ({"input_ids": torch.ones((2, 4), dtype=torch.long), "input_lengths": torch.tensor([0, 2])},
     r"^input_lengths\[0\]=0: must be in \[1, 4\]$"),
])
def test_bad_batches_are_refused_by_field(generation, data, field):
    with pytest.raises(InvalidValue, match=field):
        asyncio.run(collect(generation, data))
    _, good = mixed_batch(2)
    assert len(asyncio.run(collect(generation, good))) == 2  # still serving


def test_padding_is_never_read_as_prompt(generation):
    data = {"input_ids": torch.tensor([[3, 4, -1], [5, 6, 7]]), "input_lengths": torch.tensor([2, 3])}
    samples = dict(asyncio.run(collect(generation, data)))
    assert samples[0]["output_ids"][0, :2].tolist() == [3, 4]


def test_generate_refuses_and_points_to_generate_async(generation):
    with pytest.raises(NotImplementedError, match="generate_async"):
        generation.generate(mixed_batch(1)[1])


def test_finish_generation_invalidates_every_workers_cache(generation, server):
    before = server.flushes
    assert generation.prepare_for_generation() is True
    assert generation.finish_generation() is True
    assert server.flushes == before + 2  # two workers
    assert generation.invalidate_kv_cache() is True
    assert server.flushes == before + 4


def test_a_worker_that_refuses_the_flush_is_named(server):
    g = build_generation(CONFIG, frontend_url=server.url, control_secret="wrong",
                         workers=[WorkerEndpoint("w7", server.url)])
    try:
        with pytest.raises(WorkerFailures, match=r"flush_cache failed on 1 worker.*w7.*bad control secret"):
            g.invalidate_kv_cache()
    finally:
        g.shutdown()


def test_facts_and_refit_refusals(generation):
    from rollout_fleet.core.errors import RefitError, WorldSizeMismatch

    assert generation.frontend_url.startswith("http://127.0.0.1:")
    assert generation.get_inference_world_size() == 2
    assert generation.get_collective_sender_spec() == CollectiveSenderSpec()
    with pytest.raises(WorldSizeMismatch, match="= 3"):  # 1 trainer rank + 2 workers
        generation.init_collective("127.0.0.1", 1, 4, train_world_size=1)
    with pytest.raises(RefitError, match="before prepare_refit_info"):
        generation.update_weights_from_collective()
    with pytest.raises(RefitError, match="update_weights_via_ipc_zmq before prepare_refit_info"):
        generation.update_weights_via_ipc_zmq()


def test_logger_metrics_are_per_worker_timelines(generation, server):
    asyncio.run(collect(generation, mixed_batch(4)[1]))
    loads = generation.sample_worker_metrics()
    assert [l.worker_id for l in loads] == ["w0", "w1"]
    metrics = generation.get_logger_metrics()
    assert set(metrics) == {"inflight_requests", "kv_cache_usage", "generated_tokens", "pending_requests",
                            "prefix_cache_queried_tokens", "prefix_cache_hit_tokens"}
    for key in metrics:
        assert set(metrics[key]) == {"w0", "w1"} and len(metrics[key]["w0"]) == 1
    assert metrics["generated_tokens"]["w0"][0][1] == float(server.engine.served_count * 3)
    assert metrics["prefix_cache_hit_tokens"]["w0"][0][1] == float(server.engine.served_count * 4)
    generation.clear_logger_metrics()
    assert all(points == [] for per in generation.get_logger_metrics().values() for points in per.values())


def test_a_periodic_sampler_fills_timelines_until_shutdown(server):
    config = GenerationConfig(model=MODEL, max_model_len=48, max_new_tokens=4, metrics_interval_s=0.01)
    g = build_generation(config, frontend_url=server.url, control_secret=SECRET,
                         workers=[WorkerEndpoint("w0", server.url)])
    g.prepare_for_generation()
    for _ in range(500):  # bounded wait for a few samples; no timing is asserted
        if len(g.get_logger_metrics()["kv_cache_usage"]["w0"]) >= 3:
            break
        asyncio.run(asyncio.sleep(0.01))
    points = g.get_logger_metrics()["kv_cache_usage"]["w0"]
    assert len(points) >= 3 and [t for t, _ in points] == sorted(t for t, _ in points)
    g.shutdown()


def test_shutdown_is_safe_to_repeat_and_stops_what_it_owns_once(generation):
    assert generation.shutdown() is True
    assert generation.shutdown() is True
    assert generation.owned_for_test.stops == 1
    with pytest.raises(RolloutFleetError, match="shut down"):
        asyncio.run(collect(generation, mixed_batch(1)[1]))


def test_a_pickled_copy_generates_invalidates_and_owns_nothing(generation, server):
    copy = pickle.loads(pickle.dumps(generation))
    assert copy.is_copy and not generation.is_copy
    assert copy.frontend_url == generation.frontend_url and copy.worker_ids == ("w0", "w1")
    prompts, data = mixed_batch(5, seed=9)
    pairs = dict(asyncio.run(collect(copy, data)))
    answers = engine_answers(prompts, max_new_tokens=16, max_model_len=48)
    for index, prompt in enumerate(prompts):
        check_sample(pairs[index], prompt, answers[index])
    before = server.flushes
    assert copy.invalidate_kv_cache() is True and server.flushes == before + 2
    assert copy.shutdown() is True
    assert generation.owned_for_test.stops == 0
    assert len(asyncio.run(collect(generation, data))) == 5  # the original is untouched


def test_a_pickled_copy_works_in_another_process(generation, server):
    prompts, data = mixed_batch(6, seed=11)
    before = server.flushes
    report = run_child(pickle.dumps((generation, data)))
    assert report["is_copy"] and report["invalidated"] and report["shutdown"]
    assert server.flushes == before + 2
    answers = engine_answers(prompts, max_new_tokens=16, max_model_len=48)
    assert [i for i, _ in report["samples"]] == list(range(6))
    for (index, sample), prompt, answer in zip(report["samples"], prompts, answers):
        assert sample["output_ids"] == [prompt + list(answer.token_ids)]
        assert sample["generation_lengths"] == [len(answer.token_ids)]
    assert generation.owned_for_test.stops == 0


def run_child(payload: bytes, timeout_s: float = 120.0) -> dict:
    child = subprocess.Popen([sys.executable, "-m", "tests.driver.copy_child"], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = child.communicate(payload, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise
    assert child.returncode == 0, err.decode()[-3000:]
    return pickle.loads(out)


def test_a_failing_sample_fails_the_batch_clearly_and_the_driver_keeps_serving(generation, server):
    from tests.http.loopback_frontend import Fault
    server.faults.append(Fault(400))
    with pytest.raises(HttpStatusError) as caught:
        asyncio.run(collect(generation, mixed_batch(16)[1]))
    assert caught.value.status == 400
    assert len(asyncio.run(collect(generation, mixed_batch(16)[1]))) == 16


def test_a_transient_failure_inside_a_batch_is_retried(server):
    from rollout_fleet.core.retry import RetryPolicy
    from tests.http.loopback_frontend import Fault
    config = GenerationConfig(model=MODEL, max_model_len=48, max_new_tokens=16,
                              retry=RetryPolicy(max_attempts=3, base_delay_s=0.001, jitter=0.0))
    g = build_generation(config, frontend_url=server.url, control_secret=SECRET, workers=[])
    try:
        server.faults.extend([Fault(503), Fault(502)])
        prompts, data = mixed_batch(8, seed=6)
        pairs = dict(asyncio.run(collect(g, data)))
        answers = engine_answers(prompts, max_new_tokens=16, max_model_len=48)
        for index, prompt in enumerate(prompts):
            check_sample(pairs[index], prompt, answers[index])
    finally:
        g.shutdown()


@pytest.mark.parametrize("field,value", [("max_model_len", 0), ("max_in_flight", 0),
                                         ("control_timeout_s", 0), ("temperature", -1.0),
                                         ("stop_strings", [""]), ("metrics_interval_s", -1)])
def test_a_bad_generation_config_names_the_field(field, value):
    settings = {"model": MODEL, "max_model_len": 48, "max_new_tokens": 4, field: value}
    with pytest.raises(InvalidValue) as caught:
        GenerationConfig(**settings)
    assert field.split("_")[0] in str(caught.value)
