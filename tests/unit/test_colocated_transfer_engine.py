"""The colocated transfer engine (the class vLLM's worker runs) over a plain torch model, with
the trainer's real shared-memory pool: tensors a loader still holds after their bucket get a
copy of their own before the answer, so the trainer reusing the buffer cannot change them."""

from __future__ import annotations

import pytest
import torch

from rollout_fleet.adapters.collective.colocated import BufferPool, open_buffer
from rollout_fleet.adapters.collective.packing import pack_bucket
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.adapters.vllm.inside.colocated_engine import ColocatedTransferEngine
from rollout_fleet.core.colocated_refit import ColocatedManifest
from rollout_fleet.core.errors import RefitError


class HoldingModel:
    """Loads like vLLM's layerwise reload: the parts of a fused group (names ending in
    ``.part``) are held, as given, until the group's last part comes, then copied in."""

    def __init__(self, state):
        self.weights = {n: torch.zeros_like(t) for n, t in state.items()}
        self.pending: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, named):
        for name, tensor in named:
            self.pending.append((name, tensor))
            if not name.endswith(".part"):
                for held_name, held in self.pending:
                    self.weights[held_name].copy_(held)
                self.pending = []


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a.part": torch.randn(64, generator=g), "b.part": torch.randn(64, generator=g),
            "c": torch.randn(64, generator=g), "d": torch.randn(300, generator=g)}


def _engine(model):
    engine = ColocatedTransferEngine(None, None, torch.device("cpu"), model)
    engine.open_buffer = staticmethod(open_buffer)
    return engine


def _refit(engine, state, pool, manifest, scribble=False, keep=False):
    engine.start_weight_update()
    engine.update_weights({"colocated": {"begin": {"refit_info": manifest.info.to_wire(),
                                                   "rollback": "none", "keep_buffers": keep}}})
    for index, bucket in enumerate(manifest.plan):
        slot = index % manifest.num_buffers
        pack_bucket(pool.buffer(slot), bucket, [state[e.meta.name] for e in bucket.entries])
        engine.update_weights({"colocated": {"bucket": {
            "tensors": [[e.meta.name, e.offset] for e in bucket.entries], "nbytes": bucket.nbytes,
            "handle": pool.handle(slot).to_wire()}}})
        if scribble:  # the trainer reuses the buffer at once: the engine must not care
            pool.buffer(slot).fill_(0xFF)
    engine.update_weights({"colocated": {"end": {}}})
    engine.finish_weight_update()


def test_parts_held_across_a_bucket_end_are_copied_before_the_buffer_is_reused():
    state = _state(1)
    # 256-byte buffers: a.part, b.part, c each close a bucket; the group a, b, c spans three
    manifest = ColocatedManifest(refit_info_of(state), 256, 1, "shm")
    assert len(manifest.plan) == 4
    model = HoldingModel(state)
    engine = _engine(model)
    with BufferPool(manifest.slot_bytes, manifest.num_buffers, torch.device("cpu")) as pool:
        _refit(engine, state, pool, manifest, scribble=True)
    for name, tensor in state.items():
        assert torch.equal(model.weights[name], tensor), name
    stats = engine.stats
    assert stats.buckets == 4 and stats.tensors == 4
    assert stats.held_copy_bytes == 2 * 64 * 4  # a.part (held over 2 buckets), b.part
    assert 0 < stats.mapped_peak_bytes <= manifest.bound_bytes


def test_a_view_the_loader_keeps_beyond_reach_fails_the_bucket():
    """A loader that keeps a derived view (not the tensor it was given) cannot be moved off
    the buffer: the bucket fails rather than answer with a view left behind."""

    class Leaky(HoldingModel):
        def load_weights(self, named):
            for name, tensor in named:
                self.pending.append((name, tensor[1:]))

    state = _state(2)
    manifest = ColocatedManifest(refit_info_of(state), 1 << 12, 2, "shm")
    engine = _engine(Leaky(state))
    with BufferPool(manifest.slot_bytes, manifest.num_buffers, torch.device("cpu")) as pool:
        with pytest.raises(RefitError, match="still held"):
            _refit(engine, state, pool, manifest)
    assert engine.stats.torn  # rollback "none": reported torn, never answered as loaded


class CountingOpener:
    """The real shared-memory opener, counting what it opens and what is closed again."""

    def __init__(self):
        self.opened: list[str] = []
        self.closed: list[str] = []

    def __call__(self, handle, device):
        buffer = open_buffer(handle, device)
        self.opened.append(handle.name)
        close = buffer.close

        def counted_close():
            close()
            self.closed.append(handle.name)
        buffer.close = counted_close
        return buffer


def test_a_sender_that_keeps_its_buffers_has_them_opened_once_across_refits():
    """Kept: opened at the first refit only, each refit still exact; a new pool (new handles)
    is opened and the old one closed; released, nothing stays open; a refit that keeps none
    closes what was kept."""
    manifest = ColocatedManifest(refit_info_of(_state(0)), 256, 2, "shm")  # 4 buckets
    model = HoldingModel(_state(0))
    engine = _engine(model)
    opener = engine.open_buffer = CountingOpener()
    with BufferPool(manifest.slot_bytes, manifest.num_buffers, torch.device("cpu")) as pool:
        first_names = [pool.handle(slot).name for slot in range(manifest.num_buffers)]
        for seed in (3, 4, 5):
            state = _state(seed)
            _refit(engine, state, pool, manifest, keep=True)
            assert all(torch.equal(model.weights[n], t) for n, t in state.items()), seed
            assert engine.stats.opened_buffers == (2 if seed == 3 else 0)
        assert opener.opened == first_names and opener.closed == []
    with BufferPool(manifest.slot_bytes, manifest.num_buffers, torch.device("cpu")) as pool:
        state = _state(6)
        _refit(engine, state, pool, manifest, keep=True)
        assert engine.stats.opened_buffers == 2 and sorted(opener.closed) == sorted(first_names)
        assert all(torch.equal(model.weights[n], t) for n, t in state.items())
        assert engine.release_kept_buffers() == 2
        assert len(opener.closed) == 4 and engine.release_kept_buffers() == 0
        _refit(engine, _state(7), pool, manifest, keep=True)
        _refit(engine, _state(8), pool, manifest)  # keeps none: what was kept is closed
        assert len(opener.opened) == len(opener.closed) == 8


def test_a_failed_refit_closes_the_buffers_it_kept():
    manifest = ColocatedManifest(refit_info_of(_state(0)), 256, 2, "shm")  # 4 buckets
    engine = _engine(HoldingModel(_state(0)))
    opener = engine.open_buffer = CountingOpener()
    with BufferPool(manifest.slot_bytes, manifest.num_buffers, torch.device("cpu")) as pool:
        _refit(engine, _state(1), pool, manifest, keep=True)
        engine.start_weight_update()
        engine.update_weights({"colocated": {"begin": {"refit_info": manifest.info.to_wire(),
                                                       "rollback": "none", "keep_buffers": True}}})
        engine.update_weights({"colocated": {"abort": "the trainer gave up"}})
        engine.finish_weight_update()
    assert len(opener.opened) == len(opener.closed) == 2
