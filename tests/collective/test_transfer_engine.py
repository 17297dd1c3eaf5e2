"""The weight-transfer engine vLLM's workers run, standalone over a real gloo group (a torch
model that loads in place, as the GPU bench uses it): a refit lands bit-exact; a trainer that
dies half way is rolled back to the last complete weights (before any refit: the model folder's
checkpoint) or reported torn; a header mismatch changes nothing; a new group works again."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from rollout_fleet.adapters.collective import TorchWeightSender, init_group, join_receiver
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.adapters.vllm.messages import PackedInitInfo
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitRollback
from tests.collective.harness import free_port
from tests.support.transfer_engine import transfer_engine_over

pytestmark = pytest.mark.collective
SPEC = CollectiveSenderSpec(buffer_bytes=4096, num_buffers=2)
NAMES = [f"layers.{i}.weight" for i in range(8)]


class InPlaceModel:
    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weights = {name: torch.randn(16, 32, generator=generator) for name in NAMES}

    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.weights[name].copy_(tensor)

    def snapshot(self):
        return {name: tensor.clone() for name, tensor in self.weights.items()}


@pytest.fixture
def folder_of_seed_0(tmp_path):
    from safetensors.torch import save_file

    save_file(InPlaceModel(0).weights, str(tmp_path / "model.safetensors"))
    return tmp_path


def engine_for(model, folder):
    engine = transfer_engine_over(model, torch.device("cpu"), join_receiver)
    engine.model_config = SimpleNamespace(model=str(folder))
    return engine


def refit(engine, rollback, state, *, die_after=None, sender_spec=SPEC):
    """Join a fresh group, send ``state`` (or die after ``die_after`` tensors)."""
    port, trainer = free_port(), {}
    joining = threading.Thread(target=lambda: trainer.update(
        group=init_group("127.0.0.1", port, 0, 2, "gloo", 10.0)))
    joining.start()
    join = GroupJoin(host="127.0.0.1", port=port, world_size=2, train_world_size=1, first_rank=1,
                     ranks_per_worker=1, sender_spec=SPEC, timeout_s=10.0, backend="gloo")
    engine.init_transfer_engine(PackedInitInfo(join, RefitRollback.parse(rollback, "rollback")))
    joining.join(10)
    info = refit_info_of(state)

    def send():
        def tensors():
            for index, name in enumerate(NAMES):
                if index == die_after:
                    raise RuntimeError("the trainer died")
                yield name, state[name]
        try:
            TorchWeightSender(trainer["group"], sender_spec).send(info, tensors())
        except RolloutFleetError:
            pass
        except RuntimeError:
            pass
        trainer["group"].close()

    sending = threading.Thread(target=send)
    sending.start()
    try:
        engine.start_weight_update()
        engine.update_weights({"refit_info": info.to_wire()})
        engine.finish_weight_update()
    finally:
        sending.join(30)
        engine.shutdown()


def same(weights, other):
    return all(torch.equal(weights[name], other[name]) for name in NAMES)


@pytest.mark.parametrize("rollback", ["last_good", "none"])
def test_a_refit_lands_bit_exact(rollback, folder_of_seed_0):
    model, new = InPlaceModel(0), InPlaceModel(5).weights
    engine = engine_for(model, folder_of_seed_0)
    refit(engine, rollback, new)
    assert same(model.weights, new)
    assert engine.stats.tensors == len(NAMES) and not engine.stats.torn


def test_a_first_refit_that_dies_is_rolled_back_to_the_checkpoint_then_later_ones_work(folder_of_seed_0):
    model = InPlaceModel(0)
    original = model.snapshot()
    engine = engine_for(model, folder_of_seed_0)
    with pytest.raises(RolloutFleetError):
        refit(engine, "last_good", InPlaceModel(5).weights, die_after=5)
    assert engine.stats.rolled_back and same(model.weights, original)
    refit(engine, "last_good", InPlaceModel(6).weights)
    assert same(model.weights, InPlaceModel(6).weights)
    with pytest.raises(RolloutFleetError):  # now the previous refit's tensors are the rollback
        refit(engine, "last_good", InPlaceModel(7).weights, die_after=5)
    assert engine.stats.rolled_back and same(model.weights, InPlaceModel(6).weights)


def test_without_rollback_a_transfer_that_dies_half_way_is_reported_torn(folder_of_seed_0):
    model = InPlaceModel(0)
    engine = engine_for(model, folder_of_seed_0)
    with pytest.raises(RolloutFleetError):
        refit(engine, "none", InPlaceModel(5).weights, die_after=5)
    assert engine.stats.torn
    refit(engine, "none", InPlaceModel(6).weights)
    assert not engine.stats.torn and same(model.weights, InPlaceModel(6).weights)


def test_a_header_mismatch_changes_nothing_and_is_not_torn(folder_of_seed_0):
    model = InPlaceModel(0)
    original = model.snapshot()
    engine = engine_for(model, folder_of_seed_0)
    other_geometry = CollectiveSenderSpec(buffer_bytes=8192, num_buffers=2)
    with pytest.raises(RolloutFleetError, match="buffer_bytes"):
        refit(engine, "none", InPlaceModel(5).weights, sender_spec=other_geometry)
    assert not engine.stats.torn and same(model.weights, original)
