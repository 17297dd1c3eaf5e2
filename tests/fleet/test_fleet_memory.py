"""A fleet of in-memory-engine workers on real Ray, behind the real Dynamo frontend."""

from __future__ import annotations

import asyncio
import os

import pytest

from rollout_fleet.wiring.config import ConfigError, parse_config
from rollout_fleet.wiring.fleet import Fleet, FleetStartError
from tests.driver.conftest import check_sample, collect, engine_answers, mixed_batch
from tests.fleet.helpers import (
    assert_nothing_left, fleet_ports, non_loopback_fleet_listeners, own_children_before,
)
from tests.support.drills import FaultDrills
from tests.support.lost_worker import wait_for_in_flight
from tests.support.net import listening_sockets
from tests.support.trust import descendants, open_to_others, secret_leaks

pytestmark = pytest.mark.ray
MAX_MODEL_LEN, MAX_NEW = 128, 12


def memory_config(**overrides):
    settings = {"engine": {"kind": "memory", "seed": 0, "context_length": MAX_MODEL_LEN},
                "served_model_name": "mem", "num_workers": 2, "max_model_len": MAX_MODEL_LEN,
                "max_new_tokens": MAX_NEW, "timeouts": {"start_s": 120}} | overrides
    return parse_config(settings)


@pytest.mark.parametrize("discovery", ["file", "etcd"])
def test_a_fleet_serves_rollouts_equal_to_the_engine_and_stops_clean(discovery):
    before = own_children_before()
    fleet = Fleet.start(memory_config(discovery=discovery))
    try:
        pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
        ports = fleet_ports(fleet)
        assert non_loopback_fleet_listeners(fleet) == []
        generation = fleet.generation()
        prompts, data = mixed_batch(128, seed=3)
        pairs = asyncio.run(collect(generation, data, greedy=True))
        _check_trust(fleet)
        answers = engine_answers(prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN)
        assert sorted(i for i, _ in pairs) == list(range(128))
        for index, sample in pairs:
            check_sample(sample, prompts[index], answers[index])
        served = [generation_stats["served"] for generation_stats in _stats(fleet)]
        assert sum(served) >= 128 and all(s > 0 for s in served), f"one worker got nothing: {served}"
        generation.sample_worker_metrics()  # one sample after the batch
        metrics = generation.get_logger_metrics()
        for worker in sorted(fleet.control_urls):
            timeline = metrics["generated_tokens"][worker]
            assert timeline and timeline[-1][1] > 0, f"{worker}: no generated tokens in {metrics}"
            assert metrics["kv_cache_usage"][worker], f"{worker}: no KV usage sampled"
            assert metrics["inflight_requests"][worker], f"{worker}: no in-flight sampled"
        generation.shutdown()
    finally:
        fleet.shutdown()
        fleet.shutdown()  # safe to repeat
    assert_nothing_left(pgids, ports, before)


def _check_trust(fleet):
    """Every process this test started (Ray's daemons and actors, each worker and what it
    started, the frontend, etcd) listens on loopback only, and the control secret is in no
    command line, environment, file of the run folder or Ray's session logs."""
    import ray

    pids = descendants(os.getpid())
    listeners = listening_sockets(pids)
    assert {w.pid for w in fleet.workers} <= {s.pid for s in listeners}
    assert [s for s in listeners if not s.is_loopback] == []
    ray_session = ray._private.worker._global_node.get_session_dir_path()
    assert secret_leaks(fleet.secret, [os.getpid(), *pids], [fleet.run_dir, ray_session]) == []
    assert open_to_others(fleet.run_dir) == []


def _stats(fleet):
    from rollout_fleet.wiring.fleet import call_control

    return [call_control(url, "stats", fleet.secret) for url in fleet.control_urls.values()]


def test_a_failed_start_names_the_worker_its_own_error_and_log_and_cleans_up():
    before = own_children_before()
    # Valid as a config, refused by Dynamo's runtime inside the worker.
    config = memory_config(num_workers=1, env={"DYN_DISCOVERY_BACKEND": "no-such-backend"},
                           timeouts={"start_s": 60})
    with pytest.raises(FleetStartError) as info:
        Fleet.start(config)
    message = str(info.value)
    assert message.startswith("worker-0 exited while starting: ") and "no-such-backend" in message
    # The worker's own error, in one line, and where its log is; not a traceback's tail.
    assert "Traceback" not in message and "\n" not in message and "worker-0.log" in message, message
    assert_nothing_left([], [], before)


def test_a_misspelt_engine_option_is_refused_before_anything_starts():
    before = own_children_before()
    with pytest.raises(ConfigError) as info:
        memory_config(engine={"kind": "memory", "no_such_option": 1})
    assert "engine.no_such_option" in str(info.value)
    assert_nothing_left([], [], before)


def test_a_port_in_use_is_refused_before_anything_starts():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError) as info:
            memory_config(frontend_port=busy.getsockname()[1])
    assert "already in use" in str(info.value)


def test_a_worker_killed_mid_batch_loses_and_duplicates_nothing():
    engine = {"kind": "memory", "seed": 0, "context_length": MAX_MODEL_LEN, "token_delay_s": 0.02}
    fleet = Fleet.start(memory_config(engine=engine, retry={"max_attempts": 8, "base_delay_s": 0.2}))
    try:
        generation = fleet.generation()
        prompts, data = mixed_batch(48, seed=5)
        answers = engine_answers(prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN)
        results, errors, in_flight_at_kill = {}, [], []

        async def run_batch():
            async def killer():
                in_flight_at_kill.append(await asyncio.to_thread(wait_for_in_flight, fleet, "worker-0"))
                await asyncio.to_thread(FaultDrills(fleet).kill_worker, "worker-0")
            kill = asyncio.ensure_future(killer())
            try:
                async for index, sample in generation.generate_async(data, greedy=True):
                    assert index not in results, f"sample {index} yielded twice"
                    results[index] = sample
            except Exception as exc:  # noqa: BLE001 - a clear error is an allowed outcome
                errors.append(exc)
            await kill

        asyncio.run(run_batch())
        assert in_flight_at_kill[0] > 0, "worker-0 held no rollout when it was killed"
        assert fleet.dead_workers() == ["worker-0"]
        for index, sample in results.items():
            check_sample(sample, prompts[index], answers[index])
        if errors:
            assert "worker" in str(errors[0]).lower() or "attempt" in str(errors[0]), errors[0]
        else:
            assert sorted(results) == list(range(48)), "a rollout was silently lost"
        generation.shutdown()
    finally:
        fleet.shutdown()
