"""The fleet config's [colocation] section: each field checked, errors naming the field and
the value; the default placement (worker i's engine rank j with trainer rank i*E + j); what
it implies for the engines (sleep mode on GPUs; the GPU share reminder)."""

from __future__ import annotations

import pytest

from rollout_fleet.wiring.config import ConfigError, parse_config

MEMORY = {"engine": {"kind": "memory"}}


def test_off_by_default_and_no_worker_is_colocated():
    config = parse_config(MEMORY)
    assert not config.colocation.enabled and config.colocated_workers == {}


def test_the_default_placement_pairs_engine_ranks_with_trainer_ranks_in_order():
    config = parse_config({"engine": {"kind": "memory", "refit_ranks": 2}, "ranks_per_worker": 2,
                           "num_workers": 2, "colocation": {"enabled": True}})
    assert config.colocated_workers == {"worker-0": (0, 1), "worker-1": (2, 3)}


def test_a_mapping_names_the_colocated_workers_only():
    config = parse_config({**MEMORY, "num_workers": 3, "colocation": {
        "enabled": True, "trainer_ranks": {"worker-0": 1, "worker-2": [0]}}})
    assert config.colocated_workers == {"worker-0": (1,), "worker-2": (0,)}


@pytest.mark.parametrize("section, words", [
    ({"enabled": "yes"}, "colocation.enabled=yes: must be true or false"),
    ({"sleep_level": 3}, "colocation.sleep_level=3"),
    ({"sleep_mode": "later"}, "colocation.sleep_mode=later"),
    ({"sleep_level": 2, "sleep_mode": "keep"}, "colocation.sleep_mode=keep: a level-2 sleep"),
    ({"trainer_ranks": {"worker-0": -1}}, "colocation.trainer_ranks.worker-0=-1"),
    ({"trainer_ranks": ["worker-0"]}, "colocation.trainer_ranks=['worker-0']"),
    ({"enabled": True, "trainer_ranks": {"worker-7": [0]}}, "colocation.trainer_ranks.worker-7"),
    ({"enabled": True, "trainer_ranks": {"worker-0": [0, 1]}}, "one trainer rank per engine rank"),
    ({"enabled": True, "trainer_ranks": {"worker-0": 0, "worker-1": 0}}, "trainer rank 0 shares"),
    ({"sleep": 1}, "colocation.sleep=1: unknown key"),
])
def test_each_bad_field_is_named_with_its_value(section, words):
    with pytest.raises(ConfigError) as refused:
        parse_config({**MEMORY, "colocation": section})
    assert words in str(refused.value)


def test_a_colocated_gpu_fleet_is_reminded_of_the_engines_gpu_share():
    config = parse_config({"device": "gpu", "engine": {"kind": "memory"},
                           "colocation": {"enabled": True}})
    (reminder,) = config.colocation.reminders("gpu", {"gpu_memory_utilization": 0.9})
    assert "gpu_memory_utilization=0.9" in reminder
    assert config.colocation.reminders("gpu", {"gpu_memory_utilization": 0.4}) == []
    assert parse_config(MEMORY).colocation.reminders("gpu", {}) == []


def test_the_colocated_demos_gpu_fleet_starts_its_engine_with_sleep_mode():
    """What `rollout-fleet demo --colocated --device gpu` asks for (it runs only on a GPU):
    one colocated worker whose vLLM engine starts with sleep mode, in float32, on a share of
    the GPU; on the CPU the same demo asks for no colocation (vLLM cannot sleep there)."""
    from rollout_fleet.wiring.config import fleet_facts
    from rollout_fleet.wiring.demo.colocated import _config
    from rollout_fleet.wiring.demo.run import DemoSettings

    gpu = _config(DemoSettings(), "gpu")
    assert gpu.colocation.enabled and gpu.num_workers == 1 and gpu.device == "gpu"
    options = gpu.engine_choice.worker_table(fleet_facts(gpu), slot=0, free_port=lambda: 0)
    assert options["enable_sleep_mode"] is True and options["device"] == "gpu"
    assert options["dtype"] == "float32" and options["gpu_memory_utilization"] < 0.5
    assert not _config(DemoSettings(), "cpu").colocation.enabled
