"""A small real fleet for the driver tests and benches: Dynamo's frontend and N in-memory-engine
workers, placed as local processes by the project's fleet; checked for leftovers when stopped."""

from __future__ import annotations

from pathlib import Path

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet
from tests.support import leftover_processes

SERVED_MODEL = "mem"
ENGINE_SEED = 0
CONTEXT_LENGTH = 256


def start_local_fleet(run_dir: Path, num_workers: int = 2, *, token_delay_s: float = 0.0) -> Fleet:
    return Fleet.start(parse_config({
        "placement": "local", "num_workers": num_workers, "served_model_name": SERVED_MODEL,
        "engine": {"kind": "memory", "seed": ENGINE_SEED, "context_length": CONTEXT_LENGTH,
                   "token_delay_s": token_delay_s},
        "max_model_len": CONTEXT_LENGTH, "run_dir": str(run_dir), "timeouts": {"start_s": 120}}))


def stop_local_fleet(fleet: Fleet) -> None:
    groups = fleet.process_groups()
    fleet.shutdown()
    left = leftover_processes(groups)
    assert left == [], f"processes left behind by the driver's fleet: {left}"
