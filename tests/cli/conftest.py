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
