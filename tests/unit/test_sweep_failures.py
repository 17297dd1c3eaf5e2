"""The serving sweep goes on past a shape a server failed requests of (bench/bench_serve_sweep.py),
so one refused shape does not cost a GPU call its other shapes: run on the CPU, with the
client's runs replaced by a recorder (the servers are not what is under test here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_serve_sweep as sweep  # noqa: E402
import bench_standard_clients as servers  # noqa: E402
from sweep_records import ROUNDS_FILE, Shape  # noqa: E402


def test_a_failed_shape_is_recorded_and_the_next_shapes_still_run(tmp_path, monkeypatch):
    shapes = [Shape(4096, 1024, 64), Shape(128, 128, 64)]
    measured = []

    def measure(server, way, shape, index, arrangement, ctx):
        if shape == shapes[0] and way == sweep.VLLM:
            raise servers.IncompleteRun("http://127.0.0.1:1: 50 of 64 requests succeeded")
        measured.append((str(shape), way, index))

    monkeypatch.setattr(sweep, "measure", measure)
    args = argparse.Namespace(out=tmp_path, budget_s=None, started=0.0, fresh_client=True,
                              rounds=2, num_prompts=8, prompts_per_level=1,
                              ways=[sweep.FLEET, sweep.VLLM])
    runner = sweep.Sweep(args, tmp_path, tmp_path / "model", shapes)
    runner.interleaved({sweep.FLEET: None, sweep.VLLM: None}, "together")
    assert measured == [("4096x1024x64", "fleet", 0), ("128x128x64", "fleet", 0),
                        ("128x128x64", "vllm", 0), ("128x128x64", "vllm", 1),
                        ("128x128x64", "fleet", 1)]
    assert runner.failed == ["together 4096x1024x64: http://127.0.0.1:1: 50 of 64 requests succeeded"]
    (kept,) = [json.loads(line) for line in (tmp_path / ROUNDS_FILE).read_text().splitlines()]
    assert kept == {"arrangement": "together", "shape": "4096x1024x64",
                    "failed": "http://127.0.0.1:1: 50 of 64 requests succeeded"}
