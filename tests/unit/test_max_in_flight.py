"""One name and one default for the rollouts a driver keeps in flight: the fleet config's, the
generation config's and the HTTP pool's ``max_in_flight``; the old name is refused naming it."""

from __future__ import annotations

import pytest

from rollout_fleet.adapters.http import HttpSettings
from rollout_fleet.adapters.nemo_rl import GenerationConfig
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout_client import DEFAULT_MAX_IN_FLIGHT
from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet

REQUIRED = {"model": "m", "max_model_len": 64, "max_new_tokens": 8}


def test_every_max_in_flight_has_the_same_default():
    fleet = parse_config({"engine": {"kind": "memory"}}).max_in_flight
    generation = GenerationConfig(**REQUIRED).max_in_flight
    assert fleet == generation == HttpSettings().max_in_flight == DEFAULT_MAX_IN_FLIGHT


def test_the_old_name_is_refused_naming_the_new_one():
    with pytest.raises(InvalidValue, match="max_concurrency=16: renamed: use max_in_flight"):
        GenerationConfig(**REQUIRED, max_concurrency=16)


def test_a_fleets_driver_takes_the_fleets_max_in_flight_and_refuses_the_old_name(tmp_path):
    config = parse_config({"engine": {"kind": "memory"}, "max_in_flight": 12})
    fleet = Fleet(config, None, tmp_path, "secret")  # not started: no worker, no frontend
    generation = fleet.generation(frontend_url="http://127.0.0.1:9")  # nothing is sent
    try:
        assert generation.config.max_in_flight == 12
    finally:
        generation.shutdown()
    with pytest.raises(InvalidValue, match="renamed: use max_in_flight"):
        fleet.generation(max_concurrency=16)
