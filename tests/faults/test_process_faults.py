"""Faults of real processes: the frontend killed (and restarted on its port) mid-batch, a worker
that stops answering (SIGSTOP). Every sample comes back exactly once and equal to the engine's
own answer, or the batch fails with an error that names what failed."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from rollout_fleet.adapters.http import HttpSettings
from rollout_fleet.core.errors import RetriesExhausted, TransportError
from rollout_fleet.core.retry import RetryPolicy
from tests.faults.conftest import check_batch_exactly_once, collect_until_error, mixed_batch, run
from tests.support.drills import FaultDrills

pytestmark = [pytest.mark.faults, pytest.mark.dynamo]
MAX_NEW, MAX_LEN = 16, 64
# Enough attempts and waits to outlast a frontend restart (a few seconds here): ~25 s in all.
OUTLAST_A_RESTART = RetryPolicy(max_attempts=30, base_delay_s=0.1, backoff=1.5, max_delay_s=1.0,
                                jitter=0.2)


def test_frontend_killed_and_restarted_mid_batch_every_rollout_finishes_once(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.01)
    prompts, data = mixed_batch(96, seed=11, max_len=20)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=16, retry=OUTLAST_A_RESTART)
    killed_after = 12
    timeline: dict[str, float] = {}

    async def batch_with_a_restart():
        pairs, restart = [], None
        async for pair in generation.generate_async(data, greedy=True):
            pairs.append(pair)
            if len(pairs) == killed_after:
                FaultDrills(fleet).kill_frontend()  # SIGKILL: in-flight connections are cut, no drain
                timeline["killed"] = time.monotonic()
                restart = asyncio.ensure_future(asyncio.to_thread(restart_later))
            if "back" in timeline and "first_after" not in timeline:
                timeline["first_after"] = time.monotonic()
        await restart
        return pairs

    def restart_later():
        time.sleep(1.0)  # down long enough for every in-flight and new attempt to fail
        FaultDrills(fleet).restart_frontend(timeout_s=60)
        timeline["back"] = time.monotonic()

    try:
        pairs = run(batch_with_a_restart())
    finally:
        generation.shutdown()
    check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
    # The kill landed mid-batch: rollouts finished after the frontend came back.
    assert "first_after" in timeline, "no rollout finished after the restart: the kill missed the batch"
    assert len(pairs) - killed_after > 16


def test_frontend_down_longer_than_the_retry_budget_fails_with_a_clear_error(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.001)
    url = fleet.frontend_url
    FaultDrills(fleet).kill_frontend()
    prompts, data = mixed_batch(8, seed=12, max_len=20)
    short_budget = RetryPolicy(max_attempts=3, base_delay_s=0.05, jitter=0.2)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=8, retry=short_budget)
    try:
        pairs, error = run(collect_until_error(generation, data))
        assert pairs == []
        assert isinstance(error, RetriesExhausted), repr(error)
        assert isinstance(error.last_error, TransportError)
        assert error.attempts == 3 and f"{url}/v1/completions" in str(error)
        # Once it is back, the same driver serves the whole batch.
        FaultDrills(fleet).restart_frontend(timeout_s=60)
        pairs, error = run(collect_until_error(generation, data))
    finally:
        generation.shutdown()
    assert error is None, repr(error)
    check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)


def test_a_worker_that_stops_answering_times_out_and_its_rollouts_fail_over(start_fleet):
    fleet = start_fleet(workers=2, token_delay_s=0.005)
    prompts, data = mixed_batch(48, seed=13, max_len=20)
    # A rollout here takes ~0.1 s: an answer 2 s late is a stuck worker.
    http = HttpSettings(max_in_flight=16, read_timeout_s=2.0)
    policy = RetryPolicy(max_attempts=12, base_delay_s=0.05, backoff=1.5, max_delay_s=0.5, jitter=0.2)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN, max_in_flight=16,
                                  retry=policy, http=http)
    paused_at = 8

    async def batch_with_a_stuck_worker():
        pairs = []
        async for pair in generation.generate_async(data, greedy=True):
            pairs.append(pair)
            if len(pairs) == paused_at:
                FaultDrills(fleet).pause_worker("worker-1")  # SIGSTOP: its sockets stay open, nothing answers
        return pairs

    try:
        pairs = run(batch_with_a_stuck_worker())
        stats_while_paused = _stats_of(fleet, "worker-1")
    finally:
        FaultDrills(fleet).resume_worker("worker-1")
    try:
        # Once resumed, the worker learns that the driver gave up on its stuck rollouts (aborts).
        stats, deadline = {}, time.monotonic() + 15
        while (not stats.get("aborted_request_ids") or stats.get("in_flight")) \
                and time.monotonic() < deadline:
            stats = _stats_of(fleet, "worker-1") or {}
            time.sleep(0.2)
        assert stats.get("aborted_request_ids"), "the paused worker held no rollout the driver gave up on"
        check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)
        # Later batches complete. (Seen with Dynamo 1.6.1's file discovery: a worker paused past
        # its lease loses its registration; once resumed, its keep-alive fails to reopen that
        # file and it was not routed to again within 30 s: the fleet serves on without it.)
        more_prompts, more_data = mixed_batch(32, seed=14, max_len=20)
        more_pairs, error = run(collect_until_error(generation, more_data))
        assert error is None, repr(error)
        check_batch_exactly_once(more_pairs, more_prompts, max_new_tokens=MAX_NEW,
                                 max_model_len=MAX_LEN)
    finally:
        generation.shutdown()
    assert stats_while_paused is None, "the paused worker answered a control call"


def _stats_of(fleet, name: str):
    """The worker's own ``stats`` control answer, or None when it does not answer in 1 s."""
    body = json.dumps({"control_secret": fleet.secret}).encode()
    request = urllib.request.Request(f"{fleet.control_urls[name]}/engine/control/stats",
                                     data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=1.0) as answer:
            return json.load(answer)
    except OSError:
        return None

