"""KV routing: with ``router = "kv"`` the vLLM workers publish their KV-cache events and the
frontend sends prompts that share a long prefix to the worker that holds it (two real vLLM
workers on Ray, the real frontend; inside the private network namespace)."""

from __future__ import annotations

import httpx
import pytest

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet, call_control
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.dynamo]
PREFIX_TOKENS = 300  # two full KV blocks of 128 (vLLM's CPU block size)
FOLLOW_UPS = 3  # per prefix; at random all six land right 1 time in 64, round-robin never
SETTLE_ATTEMPTS = 40  # the events reach the router within moments; bounded all the same


def stats(fleet) -> dict[str, dict]:
    return {name: call_control(url, "stats", fleet.secret) for name, url in fleet.control_urls.items()}


def complete(fleet, prompt: list[int], pin: int | None = None) -> int:
    """One completion; returns the Dynamo instance that served it."""
    nvext = {"extra_fields": ["worker_id"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin  # Dynamo's own pin: this worker, no routing
    answer = httpx.post(f"{fleet.frontend_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "nvext": nvext})
    assert answer.status_code == 200, answer.text
    return answer.json()["nvext"]["worker_id"]["decode_worker_id"]


def test_prompts_sharing_a_long_prefix_go_to_the_worker_that_holds_it():
    before = own_children_before()
    config = parse_config({"router": "kv", "num_workers": 2, "max_model_len": 512,
                           "engine": {"kind": "vllm"}, "timeouts": {"start_s": 400}})
    fleet = Fleet.start(config)
    try:
        pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
        ports = fleet_ports(fleet)
        instance = {name: s["instance_id"] for name, s in stats(fleet).items()}
        first, second = sorted(instance)
        prefixes = {first: [(7 * i + 11) % 500 + 3 for i in range(PREFIX_TOKENS)],
                    second: [(13 * i + 5) % 500 + 3 for i in range(PREFIX_TOKENS)]}
        for name, prefix in prefixes.items():  # each worker caches one prefix
            assert complete(fleet, prefix, pin=instance[name]) == instance[name]
        # The router learns of the cached blocks from the workers' events: wait until a
        # follow-up of each prefix goes to its holder (or give up after SETTLE_ATTEMPTS).
        for attempt in range(SETTLE_ATTEMPTS):
            served = {name: complete(fleet, prefix + [400, attempt]) for name, prefix in prefixes.items()}
            if served == {name: instance[name] for name in prefixes}:
                break
        before_follow_ups = {name: s["served"] for name, s in stats(fleet).items()}
        routed = {name: [complete(fleet, prefix + [300 + k, 200 + k]) for k in range(FOLLOW_UPS)]
                  for name, prefix in prefixes.items()}
        after = {name: s["served"] for name, s in stats(fleet).items()}
        print(f"settled after {attempt + 1} round(s); follow-ups: {routed}")
        for name in prefixes:
            assert routed[name] == [instance[name]] * FOLLOW_UPS, (name, instance, routed)
            assert after[name] - before_follow_ups[name] == FOLLOW_UPS  # the workers' own counters
    finally:
        fleet.shutdown()
    assert_nothing_left(pgids, ports, before)
