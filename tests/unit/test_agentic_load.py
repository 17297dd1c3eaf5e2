"""The agentic bench's plan and figures (bench/agentic_load.py): contexts that grow as asked,
seeded draws the same on every side, and per-turn prefix-cache shares counted over the earlier
turns' tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from agentic_load import (LoadShape, TurnRecord, arm_figures, best_anchor,  # noqa: E402
                          counter_share, hit_fraction, per_turn, trajectory_plans)


def test_contexts_grow_from_the_first_to_the_last_in_the_turns_asked():
    shape = LoadShape(1024, 8, 256, 4000, 128)
    assert shape.tool_result_tokens == 389
    assert [shape.planned_prompt(t) for t in (0, 1, 7)] == [256, 773, 3875]
    assert shape.planned_prompt(7) + shape.answer_tokens == 4003  # ~4,000
    assert shape.live_tokens(7) == 1024 * 4003
    tiny = LoadShape(4, 3, 64, 256, 16)
    assert tiny.tool_result_tokens == 72 and tiny.planned_prompt(2) + 16 == 256
    assert LoadShape(2, 1, 64, 64, 16).tool_result_tokens == 0


def test_a_shape_without_room_for_tool_results_or_with_a_bad_latency_is_refused():
    with pytest.raises(ValueError, match="no room for a tool result"):
        LoadShape(4, 3, 64, 100, 32)
    with pytest.raises(ValueError, match="tool latency"):
        LoadShape(4, 3, 64, 256, 16, tool_latency_ms=(200.0, 0.0))


def test_trajectory_draws_are_seeded_by_their_label_and_within_the_latency():
    shape = LoadShape(16, 8, 256, 4000, 128)
    plans = trajectory_plans(shape, "round-0 content")
    assert plans == trajectory_plans(shape, "round-0 content")
    assert plans != trajectory_plans(shape, "round-0 frontend")
    assert len({p.content_seed for p in plans}) == 16
    latencies = [s for p in plans for s in p.tool_latencies_s]
    assert len(latencies) == 16 * 7 and all(0 <= s <= 0.2 for s in latencies)


def turn(trajectory, number, ttft, prompt, cached, earlier, ended, completion=16):
    return TurnRecord(trajectory, number, ttft, ttft * 2, prompt, completion, cached, earlier,
                      ended)


def test_figures_count_hits_over_the_earlier_turns_and_tokens_to_the_last_answer():
    records = [turn(0, 0, 0.10, 64, 0, 0, 101.0), turn(1, 0, 0.30, 64, None, 0, 101.5),
               turn(0, 1, 0.05, 160, 64, 80, 102.0), turn(1, 1, 0.07, 160, 16, 80, 104.0)]
    assert hit_fraction(records) == pytest.approx(80 / 160)  # turn 0 has no earlier tokens
    assert hit_fraction(records[:2]) is None
    rows = per_turn(records, 3)
    assert [r["answered"] for r in rows] == [2, 2, 0]
    assert rows[0]["median_ttft_ms"] == pytest.approx(200.0)
    assert rows[0]["prefix_cache_hits"] is None and rows[1]["prefix_cache_hits"] == 0.5
    assert rows[2]["median_ttft_ms"] is None
    figures = arm_figures(records, started_at=100.0, planned_turns=6)
    assert figures["output_tokens_per_s"] == pytest.approx(64 / 4.0)
    assert (figures["answered"], figures["planned"]) == (4, 6)
    assert arm_figures([], 100.0, 6)["output_tokens_per_s"] == 0.0


def test_the_best_anchor_is_the_fastest_that_answered_and_counters_are_deltas():
    figures = {"vllm": {"answered": 8, "output_tokens_per_s": 10.0},
               "vllm-k2": {"answered": 8, "output_tokens_per_s": 30.0},
               "vllm-k4": {"answered": 0, "output_tokens_per_s": 0.0}}
    assert best_anchor(figures, ["vllm", "vllm-k2", "vllm-k4", "vllm-k8"]) == "vllm-k2"
    assert best_anchor(figures, ["vllm-k8"]) is None
    share = counter_share({"h": 10.0, "q": 100.0}, {"h": 70.0, "q": 300.0}, "h", "q",
                          earlier_tokens=120)
    assert share == {"hit_tokens": 60.0, "queried_tokens": 200.0, "hits_of_queried": 0.3,
                     "hits_of_earlier": 0.5}
