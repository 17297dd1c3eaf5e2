"""The benches' small fleet: Dynamo's frontend and N in-memory-engine workers placed as local
processes, built by the project's own composition root (``Fleet``)."""

from __future__ import annotations

from pathlib import Path

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet

SERVED_MODEL = "mem"
CONTEXT_LENGTH = 256


def start_local_fleet(run_dir: Path, num_workers: int = 2) -> Fleet:
    return Fleet.start(parse_config({
        "placement": "local", "num_workers": num_workers, "served_model_name": SERVED_MODEL,
        "engine": {"kind": "memory", "seed": 0, "context_length": CONTEXT_LENGTH},
        "max_model_len": CONTEXT_LENGTH, "run_dir": str(run_dir), "timeouts": {"start_s": 120}}))


def stop_local_fleet(fleet: Fleet) -> None:
    fleet.shutdown()  # stops every process of the fleet by its process group
