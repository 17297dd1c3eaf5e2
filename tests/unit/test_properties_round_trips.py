"""Round trips of the parsers the commands read: a valid value written out reads back as the
same value (the fleet config as JSON and TOML, the fleet file, a prompts line, a worker's
``--config``)."""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_fleet.wiring.cli_generate import _parse_line
from rollout_fleet.wiring.config import load_config
from rollout_fleet.wiring.fleet_file import FleetFile
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.wiring.worker import load_worker_config
from rollout_fleet.wiring.worker_config import WorkerConfig

WORKER_FIELDS = {field.name for field in attrs.fields(WorkerConfig)}
names = st.text(string.ascii_letters + string.digits + "-_./ é", min_size=1, max_size=12)
positive = st.integers(1, 2**31)
seconds = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)

config_values = st.fixed_dictionaries({
    "served_model_name": names,
    "engine": st.fixed_dictionaries({"kind": st.just("memory")},
                                    optional={"seed": st.integers(0, 2**31),
                                              "token_delay_s": st.floats(0, 1)}),
    "num_workers": st.integers(1, 4096),
    "max_in_flight": positive,
    "max_new_tokens": positive,
    "max_model_len": st.integers(2, 2**31),
    "stop_strings": st.lists(names, max_size=32),
    "context_limit_policy": st.sampled_from(["reject", "empty"]),
    "discovery": st.sampled_from(["file", "etcd"]),
    "retry": st.fixed_dictionaries({"max_attempts": st.integers(1, 100), "base_delay_s": seconds,
                                    "backoff": st.floats(1, 10), "max_delay_s": seconds,
                                    "jitter": st.floats(0, 1)}),
    "timeouts": st.fixed_dictionaries({"start_s": seconds, "refit_s": seconds}),
    "refit": st.fixed_dictionaries({"buffer_bytes": positive, "num_buffers": st.integers(1, 64)}),
})


def _toml(data: dict, table: str = "") -> str:
    """A TOML text of ``data`` (str, int, float, list of str, and tables of those)."""
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append(_toml(value, f"{table}.{key}" if table else key))
        else:
            lines.append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
    head = [f"[{table}]"] if table else []
    return "\n".join(head + lines) + "\n" + "".join("\n" + t for t in tables)


@settings(max_examples=60, deadline=None)
@given(config_values, st.sampled_from([".json", ".toml"]))
def test_a_valid_fleet_config_file_reads_back_as_the_values_written(data, suffix):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"fleet{suffix}"
        path.write_text(json.dumps(data) if suffix == ".json" else _toml(data))
        config = load_config(path)
    dumped = config.model_dump()
    for key, value in data.items():
        if isinstance(value, dict) and key != "engine":
            assert {k: dumped[key][k] for k in value} == value, key
        else:
            assert dumped[key] == value, key


fleet_files = st.builds(
    FleetFile,
    frontend_url=st.integers(1, 65535).map("http://127.0.0.1:{}".format),
    control_urls=st.dictionaries(names, names.map("http://127.0.0.1:9000/".__add__), max_size=4),
    secret=st.text(string.hexdigits, min_size=1, max_size=32),
    serve_pid=st.integers(1, 2**22),
    served_model_name=names, max_model_len=positive, max_new_tokens=positive,
    buffer_bytes=positive, num_buffers=st.integers(1, 64), ranks_per_worker=st.integers(1, 8),
    device=st.sampled_from(["cpu", "gpu"]), collective_backend=st.sampled_from(["gloo", "nccl"]),
    processes=st.dictionaries(names, st.integers(1, 2**22), max_size=4),
    door_url=st.just("") | st.integers(1, 65535).map("http://127.0.0.1:{}".format),
)


@settings(max_examples=60, deadline=None)
@given(fleet_files)
def test_a_fleet_file_reads_back_as_the_fleet_written(fleet_file):
    with tempfile.TemporaryDirectory() as folder:
        assert FleetFile.read(fleet_file.write(Path(folder) / "fleet.json")) == fleet_file


prompt_lines = st.fixed_dictionaries(
    {"prompt_token_ids": st.lists(st.integers(0, 2**40), min_size=1, max_size=16)},
    optional={"id": names | st.integers(-(2**40), 2**40), "max_new_tokens": positive,
              "stop_strings": st.lists(names, max_size=8)})


@settings(max_examples=100)
@given(prompt_lines, st.integers(0, 1000))
def test_a_valid_prompts_line_reads_back_as_the_prompt_written(line, index):
    prompt = _parse_line(json.dumps(line), "prompts.jsonl line 1", index, tokenizer=None)
    assert prompt.token_ids == tuple(line["prompt_token_ids"])
    assert prompt.id == str(line.get("id", index))
    assert prompt.max_new_tokens == line.get("max_new_tokens")
    want_stops = line.get("stop_strings")
    assert prompt.stop_strings == (None if want_stops is None else tuple(want_stops))


json_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63)
                | st.floats(allow_nan=False, allow_infinity=False) | names)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(names, inner, max_size=4), max_leaves=24)
optional_names = st.none() | names
worker_configs = st.builds(
    WorkerConfig, run_dir=names, engine=st.dictionaries(names, json_values, max_size=4),
    served_model_name=optional_names, namespace=names, model_path=optional_names,
    system_port=st.none() | st.integers(1, 65535), kv_routing=st.booleans(),
    bind_host=optional_names,
    sigterm_grace_s=st.floats(0, 1e6), hang_timeout_s=st.none() | st.floats(1e-3, 1e6),
    collective_backend=names, log_level=names, env=st.dictionaries(names, names, max_size=3),
    hold_until_refit=st.booleans())


@settings(max_examples=60, deadline=None)
@given(worker_configs, st.sampled_from(["inline", "indented", "file"]))
def test_a_worker_config_reads_back_as_the_object_written(config, form):
    text = config.to_json()
    if form == "indented":
        text = "\n  " + text
    if form != "file":
        assert load_worker_config(text) == config
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "worker.json"
        path.write_text(text, encoding="utf-8")
        assert load_worker_config(str(path)) == config


@settings(max_examples=40, deadline=None)
@given(worker_configs, names.filter(lambda name: name not in WORKER_FIELDS), json_values)
def test_a_key_the_worker_does_not_know_is_refused_by_name(config, key, value):
    data = {**json.loads(config.to_json()), key: value}
    with pytest.raises(InvalidValue) as refused:
        load_worker_config(json.dumps(data))
    assert refused.value.field == key


def test_the_secret_never_goes_into_the_file():
    config = WorkerConfig(run_dir="/tmp/run", control_secret="s3cret")
    assert "s3cret" not in config.to_json() and "s3cret" not in repr(config)
    assert load_worker_config(config.to_json()) == attrs.evolve(config, control_secret=None)
