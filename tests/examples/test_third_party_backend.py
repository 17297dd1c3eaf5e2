"""A backend from another package, served with no change to rollout-fleet: the example
backend (examples/custom_backend.py) is built into a tiny package of its own that registers
its kind in the entry-point group ``rollout_fleet.engines``, installed into a folder of its
own, and `rollout-fleet serve` with ``engine = { kind = "counting" }`` serves it through the
real Dynamo frontend. docs/adding-a-backend.md describes exactly these steps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import COMMAND, ROOT, assert_one_line_error, cli_env, start_serve
from tests.support.processes import leftover_processes, stop_child

pytestmark = pytest.mark.dynamo

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "counting-backend"
version = "0.1.0"
dependencies = ["rollout-fleet"]

[project.entry-points."rollout_fleet.engines"]
counting = "counting_backend:CountingKind"

[tool.setuptools]
py-modules = ["counting_backend"]
"""


@pytest.fixture(scope="module")
def installed_backend(tmp_path_factory):
    """The example backend as a package of its own, installed into a site folder."""
    root = tmp_path_factory.mktemp("counting-backend")
    package = root / "package"
    package.mkdir()
    (package / "pyproject.toml").write_text(PYPROJECT)
    shutil.copy(ROOT / "examples" / "custom_backend.py", package / "counting_backend.py")
    site = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", "--no-index", "--target", str(site),
                           str(package)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (site / "counting_backend.py").is_file()
    return site


def _env(site: Path) -> dict[str, str]:
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _config(root: Path, engine: str) -> Path:
    config = root / "fleet.toml"
    config.write_text(f"""
placement = "local"
num_workers = 1
max_model_len = 64
max_new_tokens = 6
run_dir = "{root / 'run'}"
engine = {engine}
[timeouts]
start_s = 120
""")
    return config


def test_a_kind_from_another_package_is_served_by_serve(installed_backend, tmp_path):
    env = _env(installed_backend)
    log = tmp_path / "serve.log"
    serve = start_serve(_config(tmp_path, '{ kind = "counting" }'), log, env=env)
    try:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt_token_ids": [0, 1, 2]}\n{"prompt_token_ids": [24]}\n')
        out = tmp_path / "results.jsonl"
        done = subprocess.run([*COMMAND, "generate", "--fleet-file", str(tmp_path / "run" /
                               "fleet.json"), "--prompts", str(prompts), "--out", str(out),
                               "--greedy"], capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        results = [json.loads(line) for line in out.read_text().splitlines()]
        # the counting engine's greedy answer: count upward from the last prompt token, mod 26
        assert [r["token_ids"] for r in results] == [[3, 4, 5, 6, 7, 8], [25, 0, 1, 2, 3, 4]]
    finally:
        assert stop_child(serve, sig=signal.SIGINT, timeout_s=60) == 0, log.read_text()[-3000:]
    assert leftover_processes([serve.pid], wait_s=15) == []


def test_the_kind_checks_its_options_when_the_config_loads(installed_backend, tmp_path):
    config = _config(tmp_path, '{ kind = "counting", context_lenght = 64 }')
    done = subprocess.run([*COMMAND, "serve", "--config", str(config)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=_env(installed_backend),
                          stdin=subprocess.DEVNULL)
    assert_one_line_error(done, "engine.context_lenght", "not an option of the counting engine")


def test_an_unregistered_kind_names_the_registered_ones(tmp_path):
    config = _config(tmp_path, '{ kind = "counting" }')
    done = subprocess.run([*COMMAND, "serve", "--config", str(config)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=cli_env(),
                          stdin=subprocess.DEVNULL)
    assert_one_line_error(done, "engine.kind", "memory", "vllm", "rollout_fleet.engines")
