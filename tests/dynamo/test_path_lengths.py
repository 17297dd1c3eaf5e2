"""How many of the product's files one rollout and one refit run code in (docs/architecture.md
lists them): a profiler hook over a fleet of one, driver and worker in one process
(``tests/support/path_trace.py``), memory engine."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dynamo

ROOT = Path(__file__).resolve().parents[2]


def test_a_rollout_crosses_at_most_15_files_and_a_refit_at_most_20():
    # Its own process group; on a timeout it goes, and the frontend's group it named.
    trace = subprocess.Popen([sys.executable, "-m", "tests.support.path_trace"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, "DYN_LOG": "error"})
    try:
        stdout, stderr = trace.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(trace.pid, signal.SIGKILL)
        stdout, stderr = trace.communicate()
        for line in stderr.splitlines():
            if line.startswith("frontend process group "):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(int(line.rsplit(" ", 1)[1]), signal.SIGKILL)
        pytest.fail(f"the path trace ran past 240 s; its stderr ends:\n{stderr[-3000:]}")
    assert trace.returncode == 0, stderr[-3000:]
    paths = json.loads(stdout.strip().splitlines()[-1])
    rollout, refit = paths["rollout"]["files"], paths["refit"]["files"]
    # Both ends were seen: the driver's client, the worker's door, the engine, the collective.
    assert {"adapters/nemo_rl/generation.py", "adapters/dynamo/adapter.py",
            "adapters/memory/engine.py", "core/wire.py"} <= set(rollout), rollout
    assert {"adapters/nemo_rl/refit.py", "adapters/dynamo/controls.py",
            "adapters/collective/transfer.py", "core/refit_service.py"} <= set(refit), refit
    assert len(rollout) <= 15, rollout
    assert len(refit) <= 20, refit
