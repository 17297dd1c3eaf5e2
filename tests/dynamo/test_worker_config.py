"""The worker entry point's config: engine factory by kind, clear errors naming the field."""

from __future__ import annotations

import json

import pytest

from rollout_fleet.adapters.memory.engine import VOCAB, MemoryEngine
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.wiring.engines import registered_kinds
from rollout_fleet.wiring.worker import build_engine, control_secret, load_worker_config, worker_env
from rollout_fleet.wiring.worker_config import WorkerConfig

pytestmark = pytest.mark.dynamo


def test_memory_kind_builds_the_engine_and_its_model_folder(tmp_path):
    built = build_engine({"engine": {"kind": "memory", "seed": 3, "context_length": 128},
                          "run_dir": str(tmp_path)})
    assert isinstance(built.engine, MemoryEngine) and built.engine.context_length == 128
    config = json.loads((tmp_path / "model-memory" / "config.json").read_text())
    assert config["vocab_size"] == len(VOCAB) and config["max_position_embeddings"] == 128
    tokenizer = json.loads((tmp_path / "model-memory" / "tokenizer.json").read_text())
    assert tokenizer["model"]["vocab"]["<eos>"] == 0
    assert "engine_stats" in built.controls
    assert {"memory", "vllm"} <= set(registered_kinds())


@pytest.mark.parametrize("config,field", [
    ({"engine": {"kind": "tpu-magic"}, "run_dir": "/tmp"}, "engine.kind"),
    ({"engine": {"kind": "memory", "sede": 1}, "run_dir": "/tmp"}, "engine.sede"),
    ({"engine": {"kind": "memory", "token_delay_s": -1}, "run_dir": "/tmp"}, "engine.token_delay_s"),
    ({"engine": {"kind": "memory"}}, "run_dir"),
])
def test_bad_config_names_the_field(config, field):
    with pytest.raises(InvalidValue) as failure:
        build_engine(config)
    assert failure.value.field == field


def test_config_from_text_or_file(tmp_path):
    path = tmp_path / "w.json"
    path.write_text('{"engine": {"kind": "memory"}, "run_dir": "/tmp/r"}')
    assert load_worker_config(str(path)) == load_worker_config(
        '{"engine": {"kind": "memory"}, "run_dir": "/tmp/r"}')
    assert load_worker_config(str(path)).engine == {"kind": "memory"}
    with pytest.raises(InvalidValue, match="is not JSON"):
        load_worker_config("{nope")


def test_worker_env_is_loopback_and_checks_the_system_port(tmp_path):
    env = worker_env({"run_dir": str(tmp_path), "system_port": 23001})
    assert env["DYN_SYSTEM_PORT"] == "23001"
    hosts = {k: v for k, v in env.items() if k.endswith("_HOST")}
    assert len(hosts) >= 5 and set(hosts.values()) == {"127.0.0.1"}
    with pytest.raises(InvalidValue, match="signed 16-bit"):
        worker_env({"run_dir": str(tmp_path), "system_port": 40000})


def _worker(config: dict, *flags: str, stdin: str = "", timeout_s: float = 120):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "rollout_fleet.wiring.worker",
                           "--config", json.dumps(config), *flags],
                          input=stdin, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("extra,flags,stdin,field", [
    ({}, (), "", "control_secret=None: is required"),                      # no secret at all
    ({}, ("--control-secret-stdin",), "", "standard input held no secret"),
    ({"control_secret": ""}, (), "", "control_secret=(hidden): must be a non-empty string"),
], ids=["missing", "empty-stdin", "empty"])
def test_a_worker_without_a_usable_secret_refuses_to_start_naming_the_field(
        tmp_path, extra, flags, stdin, field):
    config = {"engine": {"kind": "memory"}, "run_dir": str(tmp_path), "served_model_name": "m",
              **extra}
    result = _worker(config, *flags, stdin=stdin)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("rollout-fleet worker failed: InvalidValue: ") and field in lines[0]
    assert "s3cr3t-value" not in result.stderr + result.stdout  # never echoed
    assert not (tmp_path / "home").exists()  # refused before anything started


def test_a_missing_secret_is_refused_saying_how_to_hand_one_over():
    with pytest.raises(InvalidValue, match="start the worker with --control-secret-stdin"):
        control_secret(WorkerConfig(run_dir="/tmp/r"))


def test_a_hold_until_refit_that_is_not_a_bool_is_refused_before_anything_starts(tmp_path):
    config = {"engine": {"kind": "memory"}, "run_dir": str(tmp_path), "served_model_name": "m",
              "hold_until_refit": "yes"}
    result = _worker(config, "--control-secret-stdin", stdin="s3cr3t-value\n")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "InvalidValue: hold_until_refit=yes: must be true or false" in lines[0]
    assert not (tmp_path / "home").exists()
