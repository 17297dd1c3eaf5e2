"""Every bench run sends prompts of its own (bench/fresh_prompts.py): a server's prefix cache
skips the prefill of prompts it has already seen, so a run that re-sent an earlier run's
prompts would time less work than the first. Checked with `vllm bench serve`'s own random
sampler, and through the sweep's and the other benches' rounds with the client replaced by a
recorder (the servers are not what is under test here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_grpo_groups as grpo  # noqa: E402
import bench_serve_sweep as sweep  # noqa: E402
import bench_standard_clients as servers  # noqa: E402
from fresh_prompts import prompt_seed  # noqa: E402
from sweep_records import ROUNDS_FILE, Shape  # noqa: E402

OUTCOME = {"output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0,
           "median_itl_ms": 1.0, "p99_itl_ms": 1.0, "duration": 1.0, "client_cpu_s": 0.0}


def test_vllm_bench_serve_repeats_its_prompts_under_one_seed_and_not_under_each_runs_own(tmp_path):
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import RandomDataset

    from support.gpu_models import LLAMA_1B, build_llama

    shape = {**LLAMA_1B, "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 8,
             "num_attention_heads": 1, "num_key_value_heads": 1}
    tokenizer = AutoTokenizer.from_pretrained(
        build_llama(tmp_path / "m", shape, "bfloat16", seed=0, max_positions=64))

    def prompts(seed: int, count: int) -> list[str]:
        return [request.prompt for request in RandomDataset(random_seed=seed).sample(
            tokenizer, count, input_len=32, output_len=4)]

    # What one seed for every run did: a 16-prompt run begins with the 8-prompt run's prompts.
    assert prompts(0, 16)[:8] == prompts(0, 8)
    run = Shape(32, 4, 8)
    first, second = prompts(prompt_seed(run, 0), 8), prompts(prompt_seed(run, 1), 8)
    assert first == prompts(prompt_seed(run, 0), 8)  # a run's prompts are reproducible
    assert not set(first) & set(second)


def test_the_sweep_sends_both_servers_one_prompt_set_per_round_and_every_round_its_own(
        tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(servers, "bench_round", lambda url, model, level, result, client=None: (
        sent.append((url, str(Shape(level.input_len, level.output_len, level.concurrency)),
                     level.prompt_seed)) or OUTCOME))
    args = argparse.Namespace(out=tmp_path, budget_s=None, started=0.0, fresh_client=True,
                              rounds=2, num_prompts=8, prompts_per_level=1,
                              ways=[sweep.FLEET, sweep.VLLM])
    runner = sweep.Sweep(args, tmp_path, tmp_path / "model", [Shape(64, 8, 8), Shape(64, 8, 16)])
    for way in (sweep.FLEET, sweep.VLLM):
        sweep.warm(way, way, runner)
    runner.interleaved({way: sweep.Server(way, []) for way in (sweep.FLEET, sweep.VLLM)},
                       "together")
    warm_ups, runs = sent[:2], sent[2:]
    assert [url for url, _, _ in runs] == ["fleet", "vllm", "vllm", "fleet"] * 2
    seeds = {}
    for url, shape, seed in runs:
        seeds.setdefault(shape, []).append(seed)
    # Per shape: round 0's seed twice (fleet, vllm), then round 1's twice (vllm, fleet).
    assert all(s[0] == s[1] and s[2] == s[3] for s in seeds.values()), seeds
    distinct = {seed for _, _, seed in runs}
    assert len(distinct) == 4 and warm_ups[0][2] == warm_ups[1][2] not in distinct
    kept = [json.loads(line) for line in (tmp_path / ROUNDS_FILE).read_text().splitlines()]
    assert [record["prompt_seed"] for record in kept] == [seed for _, _, seed in runs]


def test_the_standard_clients_bench_gives_each_round_its_own_seed_on_the_clients_command_line():
    args = argparse.Namespace(input_len=128, output_len=256, concurrency=64, prompts=64)
    first, second = servers.this_round(args, 0), servers.this_round(args, 1)
    assert first.prompt_seed != second.prompt_seed
    argv = servers.bench_argv("http://127.0.0.1:1", Path("/m"), second, Path("/r/out.json"))
    assert argv[argv.index("--seed") + 1] == str(second.prompt_seed)


def test_the_grpo_bench_draws_each_round_and_way_prompts_of_its_own_of_equal_work(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50_000}))
    draw = grpo.PromptDraw(tmp_path, count=4, length=16)
    runs = [draw(index, way) for index in range(2) for way in grpo.WAYS]
    assert draw(1, grpo.VLLM) == runs[len(grpo.WAYS) + grpo.WAYS.index(grpo.VLLM)]
    assert all(len(prompts) == 4 and all(len(p) == 16 for p in prompts) for prompts in runs)
    every_prompt = [tuple(p) for prompts in runs for p in prompts]
    assert len(set(every_prompt)) == len(every_prompt)
    assert len(draw("warm-up", grpo.GROUPED, count=2)) == 2
