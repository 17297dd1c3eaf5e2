"""The colocated refit in place, in one process: the trainer's tensors moved into the sender's
shared-memory buffers once, then refit after refit read from there by the memory engine (which
maps the segments as vLLM's workers do on the CPU), with nothing copied on the trainer's side."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from rollout_fleet.adapters.collective.colocated_sender import ColocatedSender
from rollout_fleet.adapters.memory.control import LocalWorkerControl
from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.adapters.memory.model import TinyBigramModel
from rollout_fleet.core.colocated_service import WorkerColocatedRefit
from rollout_fleet.core.colocated_refit import SEGMENT_PREFIX
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import GREEDY


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(rows, dtype=torch.float32)
            for name, rows in TinyBigramModel.from_seed(seed).state_dict().items()}


def answers(engine: MemoryEngine) -> list[tuple[int, ...]]:
    async def all_of():
        return [(await engine.serve_rollout([p], request_id=f"p{p}", max_new_tokens=6,
                                            sampling=GREEDY)).token_ids for p in range(3, 9)]
    return asyncio.run(all_of())


def our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm")
            if name.startswith(f"{SEGMENT_PREFIX}{os.getpid()}.")}


@pytest.fixture
def engine():
    return MemoryEngine(seed=0)


@pytest.fixture
def sender(engine):
    control = LocalWorkerControl("w0", WorkerColocatedRefit(engine).controls())
    # 800-byte buffers: each 1,536-byte matrix is a bucket of its own.
    with ColocatedSender(control, buffer_bytes=800, num_buffers=2) as sender:
        yield sender


def test_the_trainers_tensors_move_into_the_buffers_and_refit_with_nothing_copied(engine, sender):
    reference = {seed: answers(MemoryEngine(seed=seed)) for seed in (1, 2)}
    params = weights(1)
    before = {name: tensor.clone() for name, tensor in params.items()}
    sender.make_resident(params)
    assert all(torch.equal(params[name], before[name]) for name in params)  # moved, unchanged
    first = sender.send(params)
    assert (first.weight_version, first.moved_tensors, first.buckets) == (1, 0, 2)
    assert answers(engine) == reference[1]
    with torch.no_grad():  # an optimizer's step: in place, the tensors stay where they are
        for name, tensor in weights(2).items():
            params[name].copy_(tensor)
    stepped = sender.send(params)
    assert (stepped.weight_version, stepped.moved_tensors) == (2, 0)
    assert answers(engine) == reference[2]


def test_a_tensor_the_trainer_replaced_is_copied_back_into_its_place(engine, sender):
    params = weights(1)
    sender.make_resident(params)
    params["lm_head.weight"] = weights(2)["lm_head.weight"]  # a new tensor, elsewhere
    result = sender.send(params)
    assert result.moved_tensors == 1
    mixed = MemoryEngine(seed=1)
    mixed_state = {**weights(1), "lm_head.weight": weights(2)["lm_head.weight"]}
    control = LocalWorkerControl("w1", WorkerColocatedRefit(mixed).controls())
    with ColocatedSender(control, buffer_bytes=800, num_buffers=2) as plain:
        plain.send(mixed_state)
    assert answers(engine) == answers(mixed)


def test_other_tensors_are_refused_by_name_while_the_sender_holds_these(engine, sender):
    params = weights(1)
    sender.make_resident(params)
    version = engine.weight_version()
    with pytest.raises(InvalidValue, match="state_dict"):
        sender.send({"embed.weight": params["embed.weight"]})
    with pytest.raises(InvalidValue, match="device"):
        ColocatedSender(None, device="cpu").make_resident({"x": torch.zeros(2, device="meta")})
    assert engine.weight_version() == version


def test_closing_the_sender_leaves_the_tensors_alive_and_no_segment_behind(engine):
    control = LocalWorkerControl("w0", WorkerColocatedRefit(engine).controls())
    params = weights(1)
    expected = {name: tensor.clone() for name, tensor in params.items()}
    sender = ColocatedSender(control, buffer_bytes=800, num_buffers=2)
    sender.make_resident(params)
    assert len(our_segments()) == 2
    sender.close()
    assert our_segments() == set()
    params["embed.weight"].add_(1.0)  # still the trainer's memory, still writable
    assert torch.equal(params["embed.weight"], expected["embed.weight"] + 1.0)


def test_an_in_place_refit_sends_every_bucket_in_one_call(engine):
    """The trainer's buffers are not reused within a refit: start, one call with every
    bucket, finish; the engine then serves the weights sent."""
    calls = []

    def counted(name, control):
        async def call(body):
            calls.append(name)
            return await control(body)
        return call

    controls = WorkerColocatedRefit(engine).controls()
    control = LocalWorkerControl("w0", {name: counted(name, c) for name, c in controls.items()})
    params = weights(1)
    with ColocatedSender(control, buffer_bytes=800, num_buffers=2) as sender:
        sender.make_resident(params)
        result = sender.send(params)
        assert result.buckets == 2 and result.weight_version == 1
        assert calls == ["colocated_start", "colocated_buckets", "colocated_finish"]
    assert answers(engine) == answers(MemoryEngine(seed=1))


def test_a_tensor_of_another_shape_is_refused_before_the_worker_is_asked(engine, sender):
    params = weights(1)
    sender.make_resident(params)
    assert sender.send(params).weight_version == 1
    name = next(iter(params))
    with pytest.raises(InvalidValue, match=rf"state_dict\['{name}'\]"):
        sender.send({**params, name: torch.zeros(3)})
    assert engine.weight_version() == 1  # nothing started on the worker, nothing aborted
    assert sender.send(params).weight_version == 2
