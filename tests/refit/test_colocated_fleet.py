"""Colocated refit of a real one-worker vLLM fleet on the CPU: a trainer process on the same
host hands the worker's engine its weights through shared-memory buffers far smaller than the
model, over the worker's control routes (with the fleet's secret)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from tests.refit.conftest import ROOT, STEPS
from tests.refit.test_refit_fleet import assert_serves

BUFFER_BYTES = 64 << 10  # the tiny model is ~2 MiB: dozens of buckets through 2 buffers
NUM_BUFFERS = 2


@pytest.fixture(scope="module")
def colocated_fleet(models, tmp_path_factory):
    from tests.support.net import in_private_netns

    if not in_private_netns():
        pytest.fail("run the refit tier through scripts/test.sh (inside `unshare -n`)")
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    config = parse_config({
        "engine": {"kind": "vllm"}, "model": str(models[0]), "served_model_name": "tiny",
        "num_workers": 1, "placement": "local", "max_model_len": 512, "max_new_tokens": STEPS,
        "run_dir": str(tmp_path_factory.mktemp("colocated-fleet")),
        "timeouts": {"start_s": 600, "refit_s": 60}})
    fleet = Fleet.start(config)
    yield fleet
    fleet.shutdown()


class ColocatedTrainer:
    def __init__(self, fleet, worker=0):
        from rollout_fleet.wiring.colocated_trainer import worker_endpoint

        name, url = worker_endpoint(fleet, worker)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.refit.colocated_trainer_proc", str(BUFFER_BYTES),
             str(NUM_BUFFERS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        self._write(json.dumps({"worker": name, "url": url, "secret": fleet.secret}))
        assert "ready" in json.loads(self.process.stdout.readline())

    def send(self, command: str) -> dict:
        self._write(command)
        return json.loads(self.process.stdout.readline())

    def _write(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        from tests.support.processes import stop_child

        if self.process.poll() is None:
            self._write("quit")
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                pass
        stop_child(self.process)


@pytest.fixture(scope="module")
def trainer(colocated_fleet):
    trainer = ColocatedTrainer(colocated_fleet, worker=0)
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def generation(colocated_fleet):
    generation = colocated_fleet.generation()
    yield generation
    generation.shutdown()


def largest_tensor_bytes(model_dir) -> int:
    from safetensors.torch import load_file

    return max(t.numel() * t.element_size()
               for t in load_file(str(model_dir / "model.safetensors")).values())


def largest_fused_layer_bytes(model_dir) -> int:
    """The most bytes vLLM's reload may hold before a fused layer is whole (q, k, v of one
    attention; gate, up of one MLP)."""
    from safetensors.torch import load_file

    groups = defaultdict(int)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        key = re.sub(r"(q|k|v)_proj|(gate|up)_proj", lambda m: "qkv" if m.group(1) else "gate_up", name)
        groups[key] += tensor.numel() * tensor.element_size()
    return max(groups.values())


def test_a_colocated_refit_serves_the_new_weights_and_a_refit_back_the_old_exactly(
        colocated_fleet, trainer, generation, reference, models):
    assert_serves(generation, reference, 0)
    answer = trainer.send(f"send {models[1]}")
    assert "error" not in answer, answer
    assert answer["weight_version"] == 1 and answer["buckets"] > 10
    # Each buffer is the plan's largest bucket: at most the buffer size plus one tensor (the
    # 256 KiB embedding travels alone), so the pool stays a small part of the model.
    largest = largest_tensor_bytes(models[1])
    assert answer["pool_bytes"] <= NUM_BUFFERS * (BUFFER_BYTES + largest)
    assert answer["pool_bytes"] < answer["nbytes"] / 3
    assert_serves(generation, reference, 1)  # = transformers' float32 greedy decode of model 1
    engine = answer["engine"]
    assert engine["tensors"] > 0 and engine["buckets"] == answer["buckets"]
    # Receive bytes alive on the engine: the mapped buffers within the pool, and the copies of
    # fused-layer parts the reload held across a bucket's end within one fused layer.
    assert 0 < engine["mapped_peak_bytes"] <= answer["pool_bytes"]
    assert engine["held_copy_peak_bytes"] <= largest_fused_layer_bytes(models[1])
    back = trainer.send(f"send {models[0]}")
    assert back["weight_version"] == 2, back
    assert_serves(generation, reference, 0)
    assert generation.get_weight_versions() == {name: 2 for name in colocated_fleet.control_urls}


def test_a_wrong_shape_is_refused_naming_the_tensor_and_the_old_weights_serve(
        colocated_fleet, trainer, generation, reference, models):
    before = generation.get_weight_versions()
    name = "model.layers.0.mlp.down_proj.weight"
    answer = trainer.send(f"send-wrong-shape {models[1]} {name}")
    assert "error" in answer and f"shape of '{name}'" in answer["error"], answer
    assert generation.get_weight_versions() == before
    # The module's refits alternate model 1, model 0: an even version serves model 0.
    assert_serves(generation, reference, 0 if before[next(iter(before))] % 2 == 0 else 1)


# Last in the module: from here on the trainer holds its tensors in place.
def test_an_in_place_refit_loads_the_trainers_own_tensors_exactly(
        colocated_fleet, trainer, generation, reference, models):
    """The trainer's tensors move into the sender's buffers once; a refit then copies nothing
    on the trainer's side (no tensor moved), an in-place step of those tensors is what the next
    refit serves, bit for bit."""
    before = generation.get_weight_versions()[next(iter(colocated_fleet.control_urls))]
    first = trainer.send(f"resident {models[1]}")
    assert "error" not in first, first
    assert first["weight_version"] == before + 1 and first["moved_tensors"] == 0
    assert first["pool_bytes"] >= first["nbytes"]  # the model itself lives in the buffers
    assert first["engine"]["opened_buffers"] == first["buckets"]  # a buffer per bucket
    assert_serves(generation, reference, 1)
    for model in (0, 1):
        stepped = trainer.send(f"step {models[model]}")
        assert "error" not in stepped, stepped
        assert stepped["moved_tensors"] == 0 and stepped["buckets"] == first["buckets"]
        assert stepped["engine"]["opened_buffers"] == 0  # the engine kept them open
        assert_serves(generation, reference, model)
    # A state of other tensors is refused while the sender holds these; the fleet serves on.
    refused = trainer.send(f"send-wrong-shape {models[0]} model.layers.0.mlp.down_proj.weight")
    assert "state_dict" in refused.get("error", ""), refused
    assert_serves(generation, reference, 1)


def test_a_closed_sender_leaves_none_of_its_buffers_mapped_in_the_engine(colocated_fleet,
                                                                         trainer):
    """The engine kept the trainer's in-place buffers open across the refits above; the
    sender's close releases them: vLLM's model worker then maps none of its segments."""
    from rollout_fleet.core.colocated_refit import SEGMENT_PREFIX
    from tests.support.engine_core import model_worker_of

    worker = model_worker_of(colocated_fleet.workers[0].pid)
    prefix = f"{SEGMENT_PREFIX}{trainer.process.pid}."

    def mapped() -> set[str]:
        with open(f"/proc/{worker.pid}/maps") as maps:
            return {line.split("/dev/shm/")[1].split()[0] for line in maps if prefix in line}

    assert mapped(), "the engine kept no buffer of the trainer's open between refits"
    trainer.close()
    deadline = time.monotonic() + 30
    while mapped() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mapped()
