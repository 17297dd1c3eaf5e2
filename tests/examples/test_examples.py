"""The examples run, and the example backend passes the engine contract suite."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_fleet.ports.contracts.engine import EngineContract, EngineUnderTest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_embedding_example_runs():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "embed_core.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "weight versions after refit: {'worker-0': 1}" in done.stdout


@pytest.fixture(scope="class")
def engine_under_test():
    backend = _load("custom_backend")
    harness = EngineUnderTest.start(lambda: backend.CountingEngine(), decode=backend.decode,
                                    prompts=[[0, 1], [5], [9, 3, 7]])
    yield harness
    harness.close()


class TestExampleBackend(EngineContract):
    pass
