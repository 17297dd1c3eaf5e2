"""Hostile input for the fleet config: any JSON-like value parses or raises ConfigError.

A config that parses can run: its retry policy and refit spec build without error.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_fleet.core.errors import InvalidValue, RolloutFleetError
from rollout_fleet.wiring.config import ConfigError, FleetConfig, load_config, parse_config
from tests.unit.hostile import json_values, mutated, one_field_mutated, python_values

VALID_RETRY = {"max_attempts": 3, "base_delay_s": 0.1, "backoff": 2.0, "max_delay_s": 1.0, "jitter": 0.1}
VALID_TIMEOUTS = {"start_s": 30.0, "connect_s": 1.0, "request_s": 60.0, "refit_s": 60.0, "shutdown_s": 5.0}
VALID_REFIT = {"buffer_bytes": 4096, "num_buffers": 2}
VALID = {
    "model": "tiny", "served_model_name": "tiny", "engine": {"kind": "memory"}, "num_workers": 2,
    "ranks_per_worker": 1, "device": "cpu", "cpus_per_worker": 1.0, "discovery": "file",
    "etcd_endpoint": None, "ray_address": None, "bind_host": "127.0.0.1", "frontend_port": 0,
    "run_dir": None, "max_in_flight": 64, "max_new_tokens": 8, "max_model_len": 64,
    "stop_strings": ["\n"], "context_limit_policy": "reject",
    "retry": VALID_RETRY, "timeouts": VALID_TIMEOUTS, "refit": VALID_REFIT,
    "door": {"processes": 1, "port": 0, "trajectories": 64, "idle_s": 60.0, "render_threads": 1},
}

configs = st.builds(
    lambda top, retry, timeouts, refit: {**top, "retry": retry, "timeouts": timeouts, "refit": refit},
    mutated({k: v for k, v in VALID.items() if k not in ("retry", "timeouts", "refit")}),
    mutated(VALID_RETRY) | json_values, mutated(VALID_TIMEOUTS) | json_values,
    mutated(VALID_REFIT) | json_values,
)


def _without_name_lookups(data):
    """A hostile bind_host with a non-zero port (the frontend's, the door's) would make the port
    check resolve a host name."""
    if isinstance(data, dict) and data.get("bind_host", "127.0.0.1") != "127.0.0.1":
        data = {**data, "frontend_port": 0}
        if isinstance(data.get("door"), dict):
            data["door"] = {**data["door"], "port": 0}
    return data


def _parsed_or_config_error(data) -> FleetConfig | None:
    try:
        return parse_config(data, source="hostile.json")
    except ConfigError as error:
        assert str(error).startswith("hostile.json: ")
        return None


def _runnable(config: FleetConfig) -> None:
    config.retry.policy()
    config.refit.spec()
    assert config.bundle["CPU"] > 0
    assert parse_config(config.model_dump()) == config


@settings(max_examples=100)
@given(python_values)
def test_any_value_parses_or_raises_config_error(data):
    config = _parsed_or_config_error(_without_name_lookups(data))
    if config is not None:
        _runnable(config)


@settings(max_examples=100)
@given(configs.map(_without_name_lookups))
def test_any_mutated_config_parses_to_a_runnable_config_or_raises_config_error(data):
    config = _parsed_or_config_error(data)
    if config is not None:
        _runnable(config)


@settings(max_examples=120)
@given(one_field_mutated(VALID, python_values).map(lambda kv: (kv[0], _without_name_lookups(kv[1]))))
def test_a_refused_config_names_the_field_at_fault(key_and_data):
    key, data = key_and_data
    try:
        parse_config(data)
    except ConfigError as error:
        assert key in str(error)


@pytest.mark.parametrize("field, value", [("max_delay_s", float("inf")), ("base_delay_s", float("nan")),
                                          ("backoff", float("inf"))])
def test_a_retry_section_that_cannot_make_a_policy_is_refused(field, value):
    # Found by the property above: max_delay_s=inf parsed, then RetryPolicy refused it at run time.
    with pytest.raises(ConfigError, match=f"retry.{field}"):
        parse_config({**VALID, "retry": {**VALID_RETRY, field: value}})


def test_a_huge_rank_count_on_cpu_is_named_in_the_message():
    # Found by the property above: the cross-field check wrote str(10**5000) and lost the field name.
    with pytest.raises(ConfigError, match="ranks_per_worker=<unprintable int>"):
        parse_config({**VALID, "ranks_per_worker": 10**5000})


def test_a_huge_int_in_a_refused_config_does_not_break_the_message():
    # Found by the property above: repr(10**5000) raised ValueError while writing the message.
    with pytest.raises(ConfigError, match="num_workers.*unprintable int"):
        parse_config({**VALID, "num_workers": 10**5000})


@pytest.mark.parametrize("suffix, content, problem", [
    (".toml", b"a = " + b"[" * 5000, "is not valid .toml"), (".json", b"[" * 5000, "is not valid .json"),
    (".json", b"\x80", "is not UTF-8 text")])
def test_a_deep_or_undecodable_config_file_is_refused(tmp_path, suffix, content, problem):
    # Found by the property below: RecursionError from the parsers, UnicodeDecodeError from read_text.
    path = tmp_path / f"fleet{suffix}"
    path.write_bytes(content)
    with pytest.raises(InvalidValue, match=problem):
        load_config(path)


@settings(max_examples=100)
@given(st.sampled_from([".json", ".toml"]),
       st.binary(max_size=100) | st.text(max_size=100).map(str.encode)
       | st.sampled_from([b"[" * 5000, b"a = " + b"[" * 5000, b'{"retry": ' + b"[" * 5000]))
def test_any_config_file_loads_or_raises_the_projects_error(suffix, content):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"fleet{suffix}"
        path.write_bytes(content)
        try:
            load_config(path)
        except (ConfigError, InvalidValue) as error:
            assert isinstance(error, RolloutFleetError)


def test_the_retry_sections_defaults_are_the_policys_own():
    from rollout_fleet.core.retry import RetryPolicy
    from rollout_fleet.wiring.config import RetrySection

    assert RetrySection().policy() == RetryPolicy()
