"""Every subcommand's bad input: one clear line on stderr, a non-zero exit, never a traceback.
None of these start a fleet."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli.conftest import assert_one_line_error, run_cli
from tests.support.net import free_port

SUBCOMMANDS = ("demo", "serve", "generate", "refit", "build-tiny-model")


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: rollout-fleet {command}"), result.stdout[:200]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_token_ids": [3, 4]}\n')
    return path


@pytest.fixture
def fleet_file(tmp_path):
    """A well-formed fleet file of a serve process that is gone."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"frontend_url": "http://127.0.0.1:1", "secret": "s",
                                "control_urls": {"worker-0": "http://127.0.0.1:2"},
                                "serve_pid": gone.pid}))
    return path


# -- serve --------------------------------------------------------------------------------------
def test_serve_missing_config(tmp_path):
    assert_one_line_error(run_cli("serve", "--config", tmp_path / "nope.toml"), "nope.toml",
                          "cannot be read")


def test_serve_config_with_an_unknown_key(tmp_path):
    config = tmp_path / "fleet.toml"
    config.write_text('num_workers = 2\nnum_wokers = 3\n')
    assert_one_line_error(run_cli("serve", "--config", config), "num_wokers", "unknown key")


def test_serve_config_with_a_bad_value(tmp_path):
    config = tmp_path / "fleet.json"
    config.write_text(json.dumps({"num_workers": 0, "engine": {"kind": "memory"}}))
    assert_one_line_error(run_cli("serve", "--config", config), "num_workers", "0")


@pytest.mark.parametrize("toml, words", [
    ('engine = { kind = "vllm", enforce_eagr = true }\n', ("engine.enforce_eagr", "True")),
    ('model = "/no/such/model"\nengine = { kind = "vllm" }\n', ("model", "/no/such/model", "does not exist")),
    ('engine = { kind = "memory", token_delay_s = -1 }\n', ("engine.token_delay_s", "-1")),
])
def test_serve_config_with_a_bad_engine_is_refused_before_anything_starts(tmp_path, toml, words):
    config = tmp_path / "fleet.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n' + toml)
    assert_one_line_error(run_cli("serve", "--config", config), "fleet.toml", *words)
    assert not (tmp_path / "run").exists(), "something started before the config was refused"


def test_serve_config_that_is_not_toml(tmp_path):
    config = tmp_path / "fleet.toml"
    config.write_text("num_workers = = 2\n[[\n")
    assert_one_line_error(run_cli("serve", "--config", config), "fleet.toml", "not valid")


# -- generate -----------------------------------------------------------------------------------
def test_generate_missing_prompts_file(tmp_path):
    result = run_cli("generate", "--url", "http://127.0.0.1:1", "--prompts", tmp_path / "no.jsonl")
    assert_one_line_error(result, "no.jsonl", "cannot be read")


@pytest.mark.parametrize("line, words", [
    ("{not json", ["line 2", "not JSON"]),
    ('["a list"]', ["line 2", "JSON object"]),
    ('{"prompt_token_ids": [1, -5]}', ["line 2", "prompt_token_ids"]),
    ('{"prompt_token_ids": []}', ["line 2", "at least one token"]),
    ('{"prompt_token_ids": [1], "text": "ab"}', ["line 2", "exactly one"]),
    ('{"text": "hello"}', ["line 2", "--tokenizer"]),
    ('{"prompt_token_ids": [1], "max_new_tokens": 0}', ["line 2", "max_new_tokens"]),
    ('{"prompt_token_ids": [1], "stop_strings": "x"}', ["line 2", "stop_strings"]),
    ('{"prompt_token_ids": [1], "temperature": 2}', ["line 2", "temperature", "unknown key"]),
])
def test_generate_bad_jsonl_line_names_the_line(tmp_path, line, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_token_ids": [3, 4]}\n' + line + "\n")
    result = run_cli("generate", "--url", "http://127.0.0.1:1", "--prompts", path)
    assert_one_line_error(result, str(path), *words)


def test_generate_empty_prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n\n")
    assert_one_line_error(run_cli("generate", "--url", "http://127.0.0.1:1", "--prompts", path),
                          "no prompts")


def test_generate_unreachable_url(prompts):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_cli("generate", "--url", url, "--prompts", prompts)
    assert_one_line_error(result, "127.0.0.1", "attempt")


def test_generate_url_that_is_not_http(prompts):
    assert_one_line_error(run_cli("generate", "--url", "ftp://x", "--prompts", prompts),
                          "frontend_url")


def test_generate_needs_a_url(prompts):
    assert_one_line_error(run_cli("generate", "--prompts", prompts), "--url")


def test_generate_tokenizer_folder_without_tokenizer(tmp_path, prompts):
    result = run_cli("generate", "--url", "http://127.0.0.1:1", "--prompts", prompts,
                     "--tokenizer", tmp_path)
    assert_one_line_error(result, "--tokenizer", "tokenizer.json")


def test_generate_missing_fleet_file(tmp_path, prompts):
    result = run_cli("generate", "--fleet-file", tmp_path / "fleet.json", "--prompts", prompts)
    assert_one_line_error(result, "--fleet-file", "cannot be read")


def test_generate_fleet_file_of_a_stopped_fleet(fleet_file, prompts):
    result = run_cli("generate", "--fleet-file", fleet_file, "--prompts", prompts)
    assert_one_line_error(result, "is gone", "serve")


def test_generate_fleet_file_that_is_not_one(tmp_path, prompts):
    path = tmp_path / "fleet.json"
    path.write_text('{"frontend_url": "http://127.0.0.1:1"}')
    result = run_cli("generate", "--fleet-file", path, "--prompts", prompts)
    assert_one_line_error(result, "not a fleet file", "secret")


# -- refit --------------------------------------------------------------------------------------
def test_refit_missing_fleet_file(tmp_path):
    result = run_cli("refit", "--fleet-file", tmp_path / "f.json", "--checkpoint", tmp_path)
    assert_one_line_error(result, "--fleet-file", "cannot be read")


def test_refit_fleet_file_of_a_stopped_fleet(fleet_file, tmp_path):
    result = run_cli("refit", "--fleet-file", fleet_file, "--checkpoint", tmp_path)
    assert_one_line_error(result, "is gone")


def _own_fleet_file(tmp_path):
    """A fleet file naming this (running) process as its serve, so the command gets to the
    checkpoint."""
    path = tmp_path / "own-fleet.json"
    path.write_text(json.dumps({"frontend_url": f"http://127.0.0.1:{free_port()}", "secret": "s",
                                "control_urls": {"worker-0": f"http://127.0.0.1:{free_port()}"},
                                "serve_pid": os.getpid()}))
    return path


def test_refit_missing_checkpoint(tmp_path):
    result = run_cli("refit", "--fleet-file", _own_fleet_file(tmp_path),
                     "--checkpoint", tmp_path / "nope")
    assert_one_line_error(result, "--checkpoint", "not a folder")


def test_refit_checkpoint_without_safetensors(tmp_path):
    (tmp_path / "ck").mkdir()
    result = run_cli("refit", "--fleet-file", _own_fleet_file(tmp_path),
                     "--checkpoint", tmp_path / "ck")
    assert_one_line_error(result, "--checkpoint", "no *.safetensors")


def test_refit_corrupt_checkpoint(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    result = run_cli("refit", "--fleet-file", _own_fleet_file(tmp_path),
                     "--checkpoint", tmp_path / "ck")
    assert_one_line_error(result, "model.safetensors", "cannot be read")


def test_refit_unreachable_workers(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "ck").mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "ck" / "model.safetensors"))
    result = run_cli("refit", "--fleet-file", _own_fleet_file(tmp_path),
                     "--checkpoint", tmp_path / "ck", "--timeout", "20")
    assert_one_line_error(result, "prepare_refit_info", "worker-0")


# -- build-tiny-model ---------------------------------------------------------------------------
def test_build_tiny_model_into_a_path_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run_cli("build-tiny-model", tmp_path / "file" / "model"), "file")
