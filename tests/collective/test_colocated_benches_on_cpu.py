"""The colocated refit's bench and profile (bench/bench_colocated_refit.py,
bench/profile_colocated_refit.py) run their whole logic on the CPU with a tiny model, over
shared memory in place of CUDA IPC: every column bit-exact, the in-place refit's load replayed,
so they cannot rot between GPU runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.processes import run_to_end

pytestmark = pytest.mark.collective
ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, script, *args):
    code, output = run_to_end([sys.executable, str(ROOT / "bench" / script), *args],
                              log_path=tmp_path / f"{script}.log")
    assert code == 0, output[-3000:]
    return output


def test_the_colocated_bench_is_bit_exact_and_replays_the_in_place_load(tmp_path):
    output = _run(tmp_path, "bench_colocated_refit.py", "--size", "0", "--reps", "2",
                  "--buffer-mib", "1")
    rows = [line for line in output.splitlines() if line.startswith("  buffers")]
    assert len(rows) == 1 and rows[0].endswith("bit-exact: yes"), output
    assert "its load: replayed)" in rows[0], output


def test_the_colocated_profile_times_each_call_of_a_replayed_refit(tmp_path):
    output = _run(tmp_path, "profile_colocated_refit.py", "--size", "0", "--buffer-mib", "1")
    assert "calls as the trainer sees them (ms): {'colocated_start'" in output, output
    assert "'colocated_buckets'" in output and "'colocated_finish'" in output, output
    assert "'replayed': True" in output, output
