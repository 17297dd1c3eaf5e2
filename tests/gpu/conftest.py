"""The GPU tier: a real fleet on an NVIDIA GPU with GPU vLLM (scripts/gpu_bundle.sh installs
it on a machine without a package registry). Not part of the CPU suite: `pytest tests` leaves
this folder out (pyproject's norecursedirs); run it by path: `pytest tests/gpu`. Without a GPU
or GPU vLLM it fails at once, saying which is missing."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session", autouse=True)
def _gpu_and_vllm():
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the GPU tier needs torch and GPU vLLM (scripts/gpu_bundle.sh): {exc}")
    import os

    if os.environ.get("ROLLOUT_FLEET_TIER_DEVICE", "gpu") == "gpu" and not torch.cuda.is_available():
        pytest.fail("the GPU tier needs an NVIDIA GPU: torch.cuda.is_available() is False")
