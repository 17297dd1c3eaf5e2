"""The receive bytes alive inside the engine at every step of a refit, counted (no RSS): with a
loader that drops each tensor once loaded they never exceed ``num_buffers`` blocks of the
largest bucket; a loader that holds a fused layer's parts (as vLLM's layerwise reload does)
adds only the blocks those parts view; the rollback copy is counted apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout_fleet.adapters.collective import join_receiver
from tests.collective.test_transfer_engine import SPEC, refit
from tests.support.transfer_engine import transfer_engine_over

pytestmark = pytest.mark.collective
# 8 tensors of 2 KiB, 4 KiB buffers: 4 buckets of 2 tensors; a "layer" is 3 tensors in a row,
# so layers straddle buckets (as q, k, v or gate, up straddle real ones).
NAMES = [f"layers.{i}.weight" for i in range(8)]
BLOCK = 4096
BOUND = SPEC.num_buffers * BLOCK


class CountingModel:
    """Loads in place; at every tensor, notes the receiver's live bytes and which blocks the
    tensors it still holds view. ``layer`` > 1 holds each layer's parts until the last one."""

    def __init__(self, seed: int, layer: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weights = {name: torch.randn(16, 32, generator=generator) for name in NAMES}
        self.layer = layer
        self.engine = None
        self.steps: list[tuple[int, int]] = []  # (live bytes, blocks viewed only by held parts)

    def load_weights(self, named_tensors):
        held = []
        for index, (name, tensor) in enumerate(named_tensors):
            held.append((name, tensor))
            current = tensor.untyped_storage().data_ptr()
            pinned = {t.untyped_storage().data_ptr() for _, t in held} - {current}
            self.steps.append((self.engine.receiver.account.live_bytes, len(pinned)))
            if (index + 1) % self.layer == 0 or index + 1 == len(NAMES):
                for held_name, part in held:
                    self.weights[held_name].copy_(part)
                held = []
            del tensor


def engine_for(model, folder):
    engine = transfer_engine_over(model, torch.device("cpu"), join_receiver)
    engine.model_config = SimpleNamespace(model=str(folder))
    model.engine = engine
    keep = engine.shutdown
    engine.memory = []
    engine.shutdown = lambda: (engine.memory.append(engine.receive_memory()), keep())
    return engine


def state(seed):
    return CountingModel(seed).weights


def test_a_loader_that_drops_each_tensor_holds_at_most_num_buffers_blocks(tmp_path):
    model = CountingModel(0)
    engine = engine_for(model, tmp_path)
    for seed in (5, 6, 7):
        model.steps.clear()
        refit(engine, "none", state(seed))
        assert all(model.weights[n].equal(state(seed)[n]) for n in NAMES)
        live = [bytes_ for bytes_, _ in model.steps]
        assert len(live) == len(NAMES) and max(live) <= BOUND, live
        memory = engine.memory[-1]
        assert memory["peak_bytes"] <= BOUND and memory["last_good_bytes"] == 0, memory
        assert memory["live_bytes"] <= BOUND, memory  # kept for the next refit, nothing more


def test_a_loader_holding_a_layers_parts_adds_only_the_blocks_they_view(tmp_path):
    model = CountingModel(0, layer=3)
    engine = engine_for(model, tmp_path)
    refit(engine, "none", state(5))
    assert all(model.weights[n].equal(state(5)[n]) for n in NAMES)
    assert all(live <= BOUND + pinned * BLOCK for live, pinned in model.steps), model.steps
    assert any(pinned for _, pinned in model.steps)  # the case is exercised
    assert engine.memory[-1]["peak_bytes"] <= BOUND + BLOCK


def test_the_rollback_copy_is_the_models_bytes_counted_apart(tmp_path):
    model = CountingModel(0)
    engine = engine_for(model, tmp_path)
    model_bytes = sum(t.numel() * t.element_size() for t in state(5).values())
    refit(engine, "last_good", state(5))
    assert engine.memory[-1]["last_good_bytes"] == model_bytes
    assert engine.memory[-1]["live_bytes"] >= model_bytes  # its tensors view their blocks
