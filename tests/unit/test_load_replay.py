"""The in-place colocated load, recorded once and replayed: the colocated transfer engine (the
class vLLM's worker runs) over plain torch models, with the trainer's real shared-memory pool.
A replay must load exactly what the loader would, and must not happen whenever the loader did
anything but copy the buffers into the parameters, or anything it relied on changed."""

from __future__ import annotations

import pytest
import torch

from rollout_fleet.adapters.collective.colocated import BufferPool, open_buffer
from rollout_fleet.adapters.collective.packing import pack_bucket
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.adapters.vllm.inside.colocated_engine import ColocatedTransferEngine
from rollout_fleet.core.colocated_refit import ColocatedManifest
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import RefitInfo
from rollout_fleet.core.wire_memo import LastParsed


class CopyingModel:
    """Loads as vLLM's loaders do for an unquantized model: each tensor copied into its
    parameter; ``fused`` names go into halves of one parameter (as q/k/v go into qkv)."""

    def __init__(self, state):
        self.weights = {n: torch.zeros_like(t) for n, t in state.items() if n not in FUSED}
        self.weights["fused"] = torch.zeros(2 * 32)

    def state_dict(self, keep_vars=False):
        return dict(self.weights)

    def load_weights(self, named):
        for name, tensor in named:
            self.destination(name).copy_(tensor)

    def destination(self, name):
        if name in FUSED:
            return self.weights["fused"].narrow(0, FUSED.index(name) * 32, 32)
        return self.weights[name]


FUSED = ("q", "k")


class PaddingModel(CopyingModel):
    """Zeroes the rows past the loaded ones, as vLLM's padded vocabulary embedding does."""

    def __init__(self, state):
        super().__init__(state)
        self.weights["d"] = torch.full((320,), 7.0)

    def load_weights(self, named):
        for name, tensor in named:
            if name == "d":
                self.weights["d"][:300].copy_(tensor)
                self.weights["d"][300:].fill_(0)
            else:
                self.destination(name).copy_(tensor)

    def destination(self, name):
        return self.weights["d"][:300] if name == "d" else super().destination(name)


class ScalingModel(CopyingModel):
    """A loader that processes what it loads: never replayable."""

    def load_weights(self, named):
        for name, tensor in named:
            self.destination(name).copy_(tensor * 1.0)


class HalfReadingModel(CopyingModel):
    """A loader that reads half of one tensor (as a tensor-parallel shard is read)."""

    def load_weights(self, named):
        for name, tensor in named:
            if name == "d":
                self.weights["d"][:150].copy_(tensor[:150])
            else:
                self.destination(name).copy_(tensor)


def state_of(seed):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(32, generator=g), "k": torch.randn(32, generator=g),
            "c": torch.randn(64, generator=g), "d": torch.randn(300, generator=g)}


def loaded(model, name):
    return model.destination(name)


class Refitter:
    """Refits through the in-place path: every bucket in one step, the buffers kept."""

    def __init__(self, model, pool, manifest):
        self.engine = ColocatedTransferEngine(None, None, torch.device("cpu"), model)
        self.engine.open_buffer = staticmethod(open_buffer)
        self.model, self.pool, self.manifest = model, pool, manifest

    def refit(self, state, check=True):
        for slot, bucket in enumerate(self.manifest.plan):
            pack_bucket(self.pool.buffer(slot), bucket, [state[e.meta.name] for e in bucket.entries])
        self.engine.start_weight_update()
        self.engine.update_weights({"colocated": {"begin": {
            "refit_info": self.manifest.info.to_wire(), "rollback": "none", "keep_buffers": True}}})
        self.engine.update_weights({"colocated": {"buckets": [
            {"tensors": [[e.meta.name, e.offset] for e in bucket.entries],
             "nbytes": bucket.nbytes, "handle": self.pool.handle(slot).to_wire()}
            for slot, bucket in enumerate(self.manifest.plan)]}})
        self.engine.update_weights({"colocated": {"end": {}}})
        self.engine.finish_weight_update()
        for name, tensor in state.items() if check else ():
            assert torch.equal(loaded(self.model, name), tensor), name
        return self.engine.stats


@pytest.fixture
def manifest():
    return ColocatedManifest(refit_info_of(state_of(0)), 256, 3, "shm")  # 3 buckets


def pool_for(manifest):
    return BufferPool(manifest.slot_bytes, manifest.num_buffers, torch.device("cpu"))


def test_the_first_refit_is_recorded_and_the_next_ones_replay_it_exactly(manifest):
    with pool_for(manifest) as pool:
        refitter = Refitter(CopyingModel(state_of(0)), pool, manifest)
        first = refitter.refit(state_of(1))
        assert (first.replayed, first.replay_refusal) == (False, "")
        for seed in (2, 3):
            stats = refitter.refit(state_of(seed))
            assert stats.replayed and stats.tensors == 4 and stats.buckets == len(manifest.plan) > 1


def test_a_constant_the_loader_writes_into_a_parameter_is_written_again(manifest):
    model = PaddingModel(state_of(0))
    with pool_for(manifest) as pool:
        refitter = Refitter(model, pool, manifest)
        refitter.refit(state_of(1))
        for seed in (2, 3):
            model.weights["d"][300:] = 5.0  # the replay must zero the padding as the loader did
            assert refitter.refit(state_of(seed)).replayed
            assert torch.equal(model.weights["d"][300:], torch.zeros(20))


def test_a_parameter_rebound_between_refits_is_loaded_by_the_loader_again(manifest):
    model = CopyingModel(state_of(0))
    with pool_for(manifest) as pool:
        refitter = Refitter(model, pool, manifest)
        refitter.refit(state_of(1))
        assert refitter.refit(state_of(2)).replayed
        model.weights["c"] = torch.zeros(64)  # a new storage: the recorded copy would miss it
        assert not refitter.refit(state_of(3)).replayed  # and the loader filled the new one
        assert refitter.refit(state_of(4)).replayed  # recorded again


def test_new_buffers_and_a_released_hold_are_not_replayed_into(manifest):
    model = CopyingModel(state_of(0))
    with pool_for(manifest) as pool:
        refitter = Refitter(model, pool, manifest)
        refitter.refit(state_of(1))
        refitter.engine.release_kept_buffers()
        assert not refitter.refit(state_of(2)).replayed
    with pool_for(manifest) as pool:  # other segments, other handles
        refitter.pool = pool
        assert not refitter.refit(state_of(3)).replayed
        assert refitter.refit(state_of(4)).replayed


@pytest.mark.parametrize("model_class, why", [
    (ScalingModel, "the load ran aten::mul"),
    (HalfReadingModel, "the load read 1112 bytes of the buffers for 1712 loaded"),
])
def test_a_load_that_is_more_than_copies_is_never_replayed(manifest, model_class, why):
    model = model_class(state_of(0))
    with pool_for(manifest) as pool:
        refitter = Refitter(model, pool, manifest)
        for seed in (1, 2, 3):
            state = state_of(seed)
            stats = refitter.refit(state, check=False)
            assert not stats.replayed and why in stats.replay_refusal
            if model_class is HalfReadingModel:  # what this loader loads, all the same
                assert torch.equal(model.weights["d"][:150], state["d"][:150])
                assert torch.equal(model.weights["c"], state["c"])
            else:
                assert all(torch.equal(loaded(model, n), t) for n, t in state.items())


def test_a_rollback_copy_or_buffers_not_kept_are_loaded_as_always(manifest):
    model = CopyingModel(state_of(0))
    with pool_for(manifest) as pool:
        engine = Refitter(model, pool, manifest).engine
        for seed in (1, 2):
            state = state_of(seed)
            for slot, bucket in enumerate(manifest.plan):
                pack_bucket(pool.buffer(slot), bucket, [state[e.meta.name] for e in bucket.entries])
            engine.start_weight_update()
            engine.update_weights({"colocated": {"begin": {
                "refit_info": manifest.info.to_wire(), "rollback": "last_good",
                "keep_buffers": True}}})
            engine.update_weights({"colocated": {"buckets": [
                {"tensors": [[e.meta.name, e.offset] for e in bucket.entries],
                 "nbytes": bucket.nbytes, "handle": pool.handle(slot).to_wire()}
                for slot, bucket in enumerate(manifest.plan)]}})
            engine.update_weights({"colocated": {"end": {}}})
            engine.finish_weight_update()
            assert not engine.stats.replayed
            assert all(torch.equal(loaded(model, n), t) for n, t in state.items())


def test_the_same_wire_is_parsed_once_and_any_other_is_parsed_and_checked():
    calls = []

    def parse(wire):
        calls.append(wire)
        return RefitInfo.from_wire(wire)

    memo = LastParsed(parse, RefitInfo.to_wire)
    wire = refit_info_of(state_of(0)).to_wire()
    first = memo(wire)
    assert memo({**wire}) is first and len(calls) == 1
    other = refit_info_of({"x": torch.zeros(3)}).to_wire()
    assert memo(other) is not first and len(calls) == 2
    with pytest.raises(InvalidValue, match="refit_info"):
        memo({"tensors": "x"})
    assert memo(other).tensors[0].name == "x" and len(calls) == 3
