"""How many of the product's files one rollout and one refit run code in (docs/architecture.md
lists them): a profiler hook over a fleet of one, driver and worker in one process
(``tests/support/path_trace.py``), memory engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dynamo

ROOT = Path(__file__).resolve().parents[2]


def test_a_rollout_crosses_at_most_15_files_and_a_refit_at_most_20():
    out = subprocess.run([sys.executable, "-m", "tests.support.path_trace"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "DYN_LOG": "error"})
    assert out.returncode == 0, out.stderr[-3000:]
    paths = json.loads(out.stdout.strip().splitlines()[-1])
    rollout, refit = paths["rollout"]["files"], paths["refit"]["files"]
    # Both ends were seen: the driver's client, the worker's door, the engine, the collective.
    assert {"adapters/nemo_rl/generation.py", "adapters/dynamo/adapter.py",
            "adapters/memory/engine.py", "core/wire.py"} <= set(rollout), rollout
    assert {"adapters/nemo_rl/refit.py", "adapters/dynamo/controls.py",
            "adapters/collective/transfer.py", "core/refit_service.py"} <= set(refit), refit
    assert len(rollout) <= 15, rollout
    assert len(refit) <= 20, refit
