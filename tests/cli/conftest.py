"""The rollout-fleet command, run as a user runs it: a subprocess per command.

The end-to-end tests start a local Ray cluster through `serve` (its daemons bind every
interface), so this tier runs inside a private network namespace like the rest of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = (sys.executable, "-m", "rollout_fleet.wiring.cli")


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here) and "fleet" in item.fixturenames:
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.dynamo)


def cli_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, env=cli_env(), stdin=subprocess.DEVNULL)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> str:
    """Non-zero exit, exactly one line on stderr naming ``words``, and no traceback."""
    assert result.returncode != 0, f"exit 0; stdout: {result.stdout[-500:]}"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"stderr is not one line: {result.stderr[-3000:]}"
    assert lines[0].startswith("rollout-fleet "), lines[0]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def memory_fleet_toml(root: Path, *, workers: int, max_model_len: int, max_new_tokens: int,
                      extra: str = "") -> Path:
    """A fleet config of memory-engine workers (seed 0) whose run folder is ``root/run``."""
    config = root / "fleet.toml"
    config.write_text(f"""
served_model_name = "mem"
num_workers = {workers}
max_model_len = {max_model_len}
max_new_tokens = {max_new_tokens}
run_dir = "{root / 'run'}"
engine = {{ kind = "memory", seed = 0, context_length = {max_model_len}, test_controls = true }}
refit = {{ buffer_bytes = 65536, num_buffers = 2 }}
{extra}
[timeouts]
start_s = 120
""")
    return config


def start_serve(config: Path, log: Path, *, prefix: tuple[str, ...] = (),
                env: dict[str, str] | None = None, timeout_s: float = 150):
    """`rollout-fleet serve --config CONFIG` in a session of its own (``prefix``: what runs it,
    e.g. nsenter), its output in ``log``; returns once it serves, or fails with its log."""
    import time

    from tests.support.processes import stop_child

    with open(log, "wb") as out:
        process = subprocess.Popen([*prefix, *COMMAND, "serve", "--config", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=ROOT, env=env or cli_env(), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while "serving;" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_child(process)
            pytest.fail(f"serve did not come up (exit {process.returncode}):\n"
                        f"{log.read_text()[-3000:]}")
        time.sleep(0.3)
    return process
