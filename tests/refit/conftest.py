"""The refit tier: a real fleet of 2 vLLM workers on Ray, refit by a real trainer process over
gloo, checked against plain transformers greedy decodes of the two tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.net import in_private_netns

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1)  # model A, model B
STEPS = 10
MIN_TOP2_GAP = 1e-3
EOS = 2


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[int, Path]:
    from rollout_fleet.adapters.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("refit-models")
    return {seed: build_tiny_model(root / f"seed-{seed}", seed=seed) for seed in SEEDS}


def greedy_decode(model, prompt, steps=STEPS):
    import torch

    ids, tokens, logprobs, gap = list(prompt), [], [], float("inf")
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            top = torch.topk(row, 2)
            token = int(top.indices[0])
            tokens.append(token)
            logprobs.append(float(top.values[0]))
            gap = min(gap, float(top.values[0] - top.values[1]))
            ids.append(token)
            if token == EOS:
                break
    return tokens, logprobs, gap


@pytest.fixture(scope="session")
def reference(models):
    """(prompts, {seed: [(tokens, logprobs)]}): prompts free of near-ties under both models."""
    import random

    import torch
    from transformers import LlamaForCausalLM

    loaded = {s: LlamaForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for s, p in models.items()}
    rng = random.Random(7)
    prompts, answers = [], {s: [] for s in SEEDS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        while len(prompts) < 128:
            prompt = [rng.randrange(3, 512) for _ in range(rng.randint(2, 12))]
            decoded = {s: greedy_decode(m, prompt) for s, m in loaded.items()}
            if all(gap > MIN_TOP2_GAP for _, _, gap in decoded.values()):
                prompts.append(prompt)
                for s in SEEDS:
                    answers[s].append(decoded[s][:2])
    finally:
        torch.set_num_threads(threads)
    return prompts, answers


# Dynamo's own account of which workers its frontend routes to: an instance reported down (and
# why), discovery's changes. A rollout once got "model not ready" (503: no instance to route
# to) right after a refit; these lines say why if it comes again (tests/conftest.py shows them
# in a failure's report).
ROUTING_LOG = ("warn,dynamo_runtime::pipeline::network::egress::push_router=debug,"
               "dynamo_runtime::storage=info,dynamo_llm::discovery=debug")


def start_refit_fleet(models, run_dir, *, num_workers: int = 2, **timeouts):
    """A fleet of vLLM workers serving model A, refit buffers of 1 MiB x 2 (``timeouts``: more
    of the config's timeouts section)."""
    if not in_private_netns():
        pytest.fail("the refit tier starts a local Ray cluster (it binds 0.0.0.0): run it "
                    "through scripts/test.sh, which runs pytest inside `unshare -n`")
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    return Fleet.start(parse_config({
        "engine": {"kind": "vllm"}, "model": str(models[0]), "served_model_name": "tiny",
        "num_workers": num_workers, "max_model_len": 512, "max_new_tokens": STEPS,
        "run_dir": str(run_dir), "refit": {"buffer_bytes": 1 << 20, "num_buffers": 2},
        "timeouts": {"start_s": 600, "refit_s": 60, **timeouts},
        "env": {"DYN_LOG": ROUTING_LOG}}))


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    fleet = start_refit_fleet(models, tmp_path_factory.mktemp("refit-fleet"))
    yield fleet
    fleet.shutdown()


class Trainer:
    """The trainer process (tests/refit/trainer_proc.py), one refit group for its life."""

    def __init__(self, generation, *, timeout_s: float = 60.0):
        from rollout_fleet.adapters.shared import free_port

        self.port = free_port("127.0.0.1")
        world_size = 1 + generation.get_inference_world_size()
        spec = generation.get_collective_sender_spec()
        # The trainer first: its start (torch's import, slow on a loaded host) then spends none
        # of the workers' join timeout, whose clock runs from init_collective.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.refit.trainer_proc", "127.0.0.1", str(self.port),
             str(world_size), str(spec.buffer_bytes), str(spec.num_buffers), str(timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        import ray

        try:
            joining = generation.init_collective("127.0.0.1", self.port, world_size,
                                                 train_world_size=1)
            ray.get(joining, timeout=120)
            assert self.process.stdout.readline().strip() == "joined"
        except BaseException:
            self.close()
            raise

    def send(self, model_dir, die_after: int | None = None) -> None:
        command = f"send {model_dir}" if die_after is None else f"send-and-die {model_dir} {die_after}"
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def sent(self) -> str:
        return self.process.stdout.readline().strip()

    def close(self) -> None:
        from tests.support.processes import stop_child

        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
                self.process.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        stop_child(self.process)
