"""The serving sweep's own logic (bench/sweep_records.py), run on the CPU: the KV facts it reads
from vLLM's logs, its shape spelling, its time budget and its ratio table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from sweep_records import (  # noqa: E402
    ROUNDS_FILE, Budget, Shape, check_positions, engine_facts, failure_record, load_records,
    markdown, ratio_rows,
)

GPU_LOG = """INFO gpu_worker.py:760] Available KV cache memory: 40.12 GiB
INFO kv_cache_utils.py:2328] GPU KV cache size: 1,312,000 tokens, Maximum concurrency for 5,120 tokens per request: 256.25x"""
CPU_LOG = """INFO cpu_worker.py:258] Explicitly set (0.06/23.40) GiB for KV cache on node 0.
INFO kv_cache_utils.py:2328] CPU KV cache size: 32,768 tokens, Maximum concurrency for 512 tokens per request: 64.00x"""


def test_kv_facts_are_read_from_gpu_and_cpu_logs_and_absent_ones_say_so():
    assert engine_facts(GPU_LOG) == {"kv_cache_gib": 40.12, "kv_cache_tokens": 1_312_000,
                                     "max_concurrency": 256.25, "max_model_len": 5120}
    assert engine_facts(CPU_LOG)["kv_cache_gib"] == 0.06
    assert set(engine_facts("nothing logged").values()) == {None}


def test_a_shape_is_spelled_in_x_out_x_concurrency_and_a_bad_one_is_named():
    assert Shape.parse("1024x128x256") == Shape(1024, 128, 256)
    assert str(Shape(4096, 1024, 64)) == "4096x1024x64"
    with pytest.raises(ValueError, match="'1024x0x8'"):
        Shape.parse("1024x0x8")


def test_the_budget_admits_the_first_shape_then_estimates_from_the_slowest_pace():
    budget = Budget(100.0, started=0.0, reserve_s=0.0)
    assert budget.fits(now=10.0, work=1e9)  # nothing measured yet
    budget.record(work=100.0, seconds=20.0)
    budget.record(work=100.0, seconds=10.0)  # a faster pace does not lower the estimate
    assert budget.fits(now=50.0, work=250.0) and not budget.fits(now=51.0, work=250.0)
    assert Budget(None, started=0.0).fits(now=1e9, work=1e9)


def test_ratios_are_fleet_over_vllm_of_the_medians_and_one_sided_shapes_are_left_out():
    def run(way, shape, tokens_s, ttft_ms):
        return {"arrangement": "resident", "shape": shape, "way": way, "output_throughput": tokens_s,
                "median_ttft_ms": ttft_ms, "median_tpot_ms": 1.0}

    rounds = [run("fleet", "128x128x64", 90, 30), run("fleet", "128x128x64", 100, 10),
              run("fleet", "128x128x64", 300, 20), run("vllm", "128x128x64", 200, 10),
              run("fleet", "4096x128x64", 1, 1)]
    (row,) = ratio_rows(rounds)
    assert (row["shape"], row["tokens_ratio"], row["ttft_ratio"]) == (Shape(128, 128, 64), 0.5, 2.0)
    assert "| vLLM's server, 1 API process | **0.500** | **2.00x**" in markdown(
        rounds, {"fleet": {"kv_cache_gib": None}})


def test_each_shapes_ratio_is_to_its_best_anchor_and_every_anchor_is_listed():
    def run(way, shape, tokens_s, ttft_ms):
        return {"arrangement": "together", "shape": shape, "way": way, "output_throughput": tokens_s,
                "median_ttft_ms": ttft_ms, "median_tpot_ms": 1.0}

    rounds = [run("fleet", "128x128x64", 120, 10), run("vllm", "128x128x64", 60, 30),
              run("vllm-k4", "128x128x64", 100, 20), run("dynamo-vllm", "128x128x64", 80, 5),
              run("fleet", "4096x128x64", 90, 10), run("dynamo-vllm", "4096x128x64", 100, 10)]
    rows = {str(row["shape"]): row for row in ratio_rows(rounds)}
    assert (rows["128x128x64"]["anchor"], rows["128x128x64"]["tokens_ratio"],
            rows["128x128x64"]["ttft_ratio"]) == ("vllm-k4", 1.2, 0.5)
    assert (rows["4096x128x64"]["anchor"], rows["4096x128x64"]["tokens_ratio"]) == ("dynamo-vllm", 0.9)
    table = markdown(rounds, {})
    assert "| vLLM's server, 4 API processes | **1.200** | **0.50x** |" in table
    assert "| Dynamo's vLLM worker + Dynamo's frontend | **0.900** |" in table
    assert table.splitlines()[0].endswith("| vllm tokens/s | vllm-k4 tokens/s | dynamo-vllm tokens/s |")
    assert "| 60 | 100 | 80 |" in table and "| - | - | 100 |" in table


def test_a_reused_model_folder_too_short_for_the_runs_context_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 1280}')
    assert check_positions(tmp_path, 1280) == tmp_path
    with pytest.raises(SystemExit, match=r"1280 positions, this run needs max_model_len 5376"):
        check_positions(tmp_path, 5376)


def _run(way, shape, tokens_s, ttft_ms):
    return {"arrangement": "together", "shape": shape, "way": way, "output_throughput": tokens_s,
            "median_ttft_ms": ttft_ms, "median_tpot_ms": 1.0}


def test_a_shape_a_server_failed_gets_no_ratio_even_from_rounds_before_the_failure_and_is_named():
    rounds = [_run("fleet", "4096x1024x64", 100, 10), _run("vllm", "4096x1024x64", 100, 10),
              failure_record("together", Shape(4096, 1024, 64), "50 of 64 requests succeeded"),
              _run("fleet", "128x128x64", 100, 10), _run("vllm", "128x128x64", 50, 10)]
    assert [row["shape"] for row in ratio_rows(rounds)] == [Shape(128, 128, 64)]
    table = markdown(rounds, {})
    assert "- together 4096x1024x64: 50 of 64 requests succeeded" in table
    assert "| together | 4096 | 1024 | 64 |" not in table


def test_each_rounds_ratio_pairs_the_two_ways_of_one_round_of_one_call(tmp_path):
    """The table shows the spread its medians hide: a round's ratio pairs that round's two
    ways, never rounds of different calls (combined calls number their rounds alike)."""
    import json

    def round_of(way, index, tokens_s):
        return {**_run(way, "1024x1024x64", tokens_s, 10), "round": index}

    calls = [[round_of("fleet", 0, 90), round_of("vllm", 0, 100), round_of("vllm", 1, 80),
              round_of("fleet", 1, 100)],
             [round_of("fleet", 0, 120), round_of("vllm", 0, 100), round_of("fleet", 1, 50)]]
    for number, records in enumerate(calls):
        folder = tmp_path / f"call{number}"
        folder.mkdir()
        (folder / ROUNDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    rounds, _ = load_records([tmp_path / "call0", tmp_path / "call1"])
    (row,) = ratio_rows(rounds)
    assert row["round_ratios"] == [0.9, 1.2, 1.25]  # call 1's round 1 ran one way only
    assert "| 3 | 0.900-1.250 |" in markdown(rounds, {})
