"""What one memory-engine worker process weighs once started and serving: a fleet of 128 such
workers has to fit one host. Torch (about 145 MiB of a process's own memory) is imported only
when the worker first joins a refit group, so a worker that serves and has not been refit maps
no torch library at all."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet
from tests.driver.conftest import collect, mixed_batch

pytestmark = pytest.mark.dynamo
# Measured here: 108 MiB resident, 39 MiB of it the process's own (USS), 55 MiB proportional (PSS).
RSS_BOUND_MIB = 150
USS_BOUND_MIB = 80
MAX_MODEL_LEN = 128


def test_a_started_memory_worker_stays_under_its_memory_bound(tmp_path):
    fleet = Fleet.start(parse_config({
        "placement": "local", "num_workers": 1, "served_model_name": "mem",
        "engine": {"kind": "memory", "seed": 0, "context_length": MAX_MODEL_LEN},
        "max_model_len": MAX_MODEL_LEN, "max_new_tokens": 16, "run_dir": str(tmp_path / "run"),
        "timeouts": {"start_s": 120}}))
    try:
        generation = fleet.generation()
        _, data = mixed_batch(64, seed=5)
        assert len(asyncio.run(collect(generation, data))) == 64  # it served, then is measured
        generation.shutdown()
        worker = psutil.Process(fleet.workers[0].pid)
        assert worker.children(recursive=True) == []  # one process: its engine is in it
        memory = worker.memory_full_info()
        figures = (f"RSS {memory.rss / 2**20:.0f} MiB, USS {memory.uss / 2**20:.0f} MiB, "
                   f"PSS {memory.pss / 2**20:.0f} MiB")
        assert memory.rss <= RSS_BOUND_MIB * 2**20, figures
        assert memory.uss <= USS_BOUND_MIB * 2**20, figures
        assert torch_libraries(worker.pid) == [], f"torch loaded before any refit ({figures})"
    finally:
        fleet.shutdown()


def torch_libraries(pid: int) -> list[str]:
    """The torch shared libraries mapped into process ``pid``."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "libtorch" in line.split()[-1]})
