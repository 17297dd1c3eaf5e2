"""A fleet placed as local processes: its config is strict, and Dynamo's KV router works behind
it (only inside a private network namespace, which the test command provides)."""

from __future__ import annotations

import pytest

from rollout_fleet.wiring.config import ConfigError
from rollout_fleet.wiring.fleet import call_control
from tests.support.net import in_private_netns
from tests.faults.conftest import (
    check_batch_exactly_once, collect_until_error, local_memory_config, mixed_batch, run,
)

pytestmark = [pytest.mark.faults, pytest.mark.dynamo]


@pytest.mark.parametrize("options, field", [
    ({"workers": 0}, "num_workers"),
    ({"router": "fastest"}, "router"),
])
def test_bad_options_are_refused_by_name(tmp_path, options, field):
    with pytest.raises(ConfigError) as refused:
        local_memory_config(tmp_path, **options)
    assert field in str(refused.value)


def test_the_kv_router_serves_every_rollout_once_inside_a_private_namespace(start_fleet):
    if not in_private_netns():
        pytest.fail("run through scripts/test.sh (or `unshare -n`): the KV router binds 0.0.0.0")
    fleet = start_fleet(workers=3, token_delay_s=0.001, router="kv")
    prompts, data = mixed_batch(48, seed=51, max_len=20)
    generation = fleet.generation(max_new_tokens=12, max_model_len=64, max_in_flight=16)
    try:
        pairs, error = run(collect_until_error(generation, data))
    finally:
        generation.shutdown()
    assert error is None, repr(error)
    check_batch_exactly_once(pairs, prompts, max_new_tokens=12, max_model_len=64)
    # The KV router (not the default push router) took the workers in: it logs each one.
    log = fleet.frontend.log_path.read_text(errors="replace")
    assert log.count("dynamo_kv_router") >= 3, log[-2000:]


def test_a_started_fleet_routes_to_every_worker_at_once(start_fleet):
    """Fleet.start returns once the frontend knows every worker (no settling sleep): the very
    first batch, round-robin, reaches each of them."""
    fleet = start_fleet(workers=3)
    assert set(fleet.instance_ids.values()) <= fleet.frontend.known_instances()
    prompts, data = mixed_batch(12, seed=7, max_len=8)
    generation = fleet.generation(max_new_tokens=4, max_model_len=64, max_in_flight=4)
    try:
        pairs, error = run(collect_until_error(generation, data))
    finally:
        generation.shutdown()
    assert error is None, repr(error)
    served = {name: call_control(url, "stats", fleet.secret)["served"]
              for name, url in fleet.control_urls.items()}
    assert all(count > 0 for count in served.values()), served
