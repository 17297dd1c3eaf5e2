"""The two-GPU refit bench (bench/bench_gpu_refit.py) runs its whole logic on the CPU, over gloo,
with a tiny model: trainer and engine processes, the in-engine receiver loading into a torch
Llama, and the bit-exact logits check, so it cannot rot between GPU runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.processes import run_to_end

pytestmark = pytest.mark.collective
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_refit_bench_runs_on_the_cpu_and_every_geometry_is_bit_exact(tmp_path):
    code, output = run_to_end([sys.executable, str(ROOT / "bench" / "bench_gpu_refit.py"),
                               "--device", "cpu", "--reps", "1"], log_path=tmp_path / "bench.log")
    assert code == 0, output[-3000:]
    rows = [line for line in output.splitlines() if line.startswith("  buffer")]
    assert len(rows) == 4, output  # 2 buffer sizes x 2 in flight
    assert all(line.endswith("bit-exact: yes") for line in rows), output
    assert "bit-exact in every geometry: yes" in output
