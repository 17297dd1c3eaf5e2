"""`serve` of a model that Dynamo's frontend cannot materialise fails as soon as the frontend
gives up on it (not after the start timeout), with the frontend's own reason on one line (no
colour codes)."""

from __future__ import annotations

import json
import time

import pytest

from rollout_fleet.adapters.memory.model_folder import write_model_folder
from tests.support.net import in_private_netns
from tests.cli.conftest import run_cli

START_TIMEOUT_S = 600  # far beyond the failure: a wait that ran it out would fail the test


@pytest.fixture
def fleet():  # marks this test as one that starts a fleet (ray, dynamo)
    if not in_private_netns():
        pytest.fail("serve starts a local Ray cluster (it binds 0.0.0.0): run inside `unshare -n`")


def test_serve_of_a_model_the_frontend_rejects_fails_fast_on_one_line(fleet, tmp_path):
    folder = write_model_folder(tmp_path / "model")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m.content }"  # broken Jinja
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = tmp_path / "fleet.toml"
    config.write_text(f"""
model = "{folder}"
served_model_name = "broken"
num_workers = 1
max_model_len = 128
run_dir = "{tmp_path / 'run'}"
engine = {{ kind = "memory", seed = 0, context_length = 128 }}
[timeouts]
start_s = {START_TIMEOUT_S}
""")
    started = time.monotonic()
    result = run_cli("serve", "--config", config, timeout_s=START_TIMEOUT_S / 2)
    took = time.monotonic() - started
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    # Ray's own start-up warnings may precede it; the command's error is one line of its own.
    ours = [line for line in result.stderr.splitlines() if line.startswith("rollout-fleet ")]
    assert len(ours) == 1, result.stderr[-3000:]
    line = ours[0]
    assert line.startswith("rollout-fleet serve: error: the frontend cannot serve model 'broken': "
                           "prompt_formatter_from_mdc: syntax error"), line
    assert "\x1b" not in result.stderr
    print(f"serve failed after {took:.1f} s (Ray, a worker and the frontend started first): {line}")
