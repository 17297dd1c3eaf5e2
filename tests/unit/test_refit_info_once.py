"""A refit's info (every tensor's name, shape and dtype) crosses once per change: the vLLM
host's refit and colocated messages and the driver's IPC updates carry it only when it differs
from the last one the other side received, the other side keeps it, and a failed refit (or a
new join) makes both sides forget it, so the next message carries it again."""

from __future__ import annotations

import pytest
import torch

from rollout_fleet.adapters.collective.colocated import BufferPool, open_buffer
from rollout_fleet.adapters.collective.packing import pack_bucket
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.adapters.memory import LocalWorkerControl
from rollout_fleet.adapters.vllm.inside.colocated_engine import ColocatedTransferEngine
from rollout_fleet.adapters.vllm.messages import (
    ColocatedBegin, ColocatedBucket, ColocatedUpdate, PackedUpdateInfo, RefitInfoOnce,
)
from rollout_fleet.core.colocated_refit import ColocatedManifest, ColocatedStep
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.refit import RefitInfo, RefitRollback
from rollout_fleet.core.refit_service import RefitCoordinator

INFO = RefitInfo.from_state_dict_info({"a": ((4, 2), "float32"), "b": ((3,), "bfloat16")})
OTHER = RefitInfo.from_state_dict_info({"a": ((4, 2), "float32")})


def test_the_host_sends_an_info_only_when_it_changed_and_again_after_forgetting():
    host = RefitInfoOnce()
    assert host.outgoing(INFO) is INFO
    assert host.outgoing(RefitInfo.from_wire(INFO.to_wire())) is None  # equal: held there
    assert host.outgoing(OTHER) is OTHER
    host.forget()
    assert host.outgoing(OTHER) is OTHER


def test_the_inside_keeps_what_came_and_refuses_a_refit_without_one_it_holds():
    inside = RefitInfoOnce()
    with pytest.raises(RefitError, match="without its refit info"):
        inside.incoming(None)
    assert inside.incoming(INFO) is INFO
    assert inside.incoming(None) is INFO
    inside.forget()
    with pytest.raises(RefitError, match="without its refit info"):
        inside.incoming(None)


@pytest.mark.parametrize("message", [
    PackedUpdateInfo(INFO, ("b",)), PackedUpdateInfo(None, ("b",)),
    ColocatedUpdate(ColocatedStep.BEGIN, begin=ColocatedBegin(INFO, ("b",), RefitRollback.LAST_GOOD,
                                                              True)),
    ColocatedUpdate(ColocatedStep.BEGIN, begin=ColocatedBegin(None)),
    ColocatedUpdate(ColocatedStep.END), ColocatedUpdate(ColocatedStep.ABORT, reason="gone"),
])
def test_each_message_reads_back_as_it_was_sent(message):
    assert type(message).from_wire(message.to_wire()) == message
    if isinstance(message, PackedUpdateInfo) and message.info is None:
        assert "refit_info" not in message.to_wire()


def test_a_colocated_bucket_reads_back_with_its_handle():
    manifest = ColocatedManifest(INFO, 256, 1, "shm")
    with BufferPool(manifest.slot_bytes, 1, torch.device("cpu")) as pool:
        step = ColocatedUpdate(ColocatedStep.BUCKETS, buckets=tuple(
            ColocatedBucket.of(bucket, pool.handle(0)) for bucket in manifest.plan))
        assert ColocatedUpdate.from_wire(step.to_wire()) == step


class CopyingModel:
    def __init__(self, state):
        self.weights = {n: torch.zeros_like(t) for n, t in state.items()}

    def load_weights(self, named):
        for name, tensor in named:
            self.weights[name].copy_(tensor)


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"c": torch.randn(64, generator=g), "d": torch.randn(300, generator=g)}


def _refit(engine, state, pool, manifest, *, with_info):
    engine.start_weight_update()
    engine.update_weights(ColocatedUpdate(ColocatedStep.BEGIN, begin=ColocatedBegin(
        manifest.info if with_info else None)).to_wire())
    for slot, bucket in enumerate(manifest.plan):
        pack_bucket(pool.buffer(slot), bucket, [state[e.meta.name] for e in bucket.entries])
    engine.update_weights(ColocatedUpdate(ColocatedStep.BUCKETS, buckets=tuple(
        ColocatedBucket.of(bucket, pool.handle(slot))
        for slot, bucket in enumerate(manifest.plan))).to_wire())
    engine.update_weights(ColocatedUpdate(ColocatedStep.END).to_wire())
    engine.finish_weight_update()


def test_a_colocated_engine_loads_with_the_info_it_kept_until_a_refit_fails():
    manifest = ColocatedManifest(refit_info_of(_state(0)), 4096, 1, "shm")
    model = CopyingModel(_state(0))
    engine = ColocatedTransferEngine(None, None, torch.device("cpu"), model)
    engine.open_buffer = staticmethod(open_buffer)
    with BufferPool(manifest.slot_bytes, manifest.num_buffers, torch.device("cpu")) as pool:
        with pytest.raises(RefitError, match="without its refit info"):
            _refit(engine, _state(1), pool, manifest, with_info=False)  # none held yet
        engine.finish_weight_update()
        _refit(engine, _state(1), pool, manifest, with_info=True)
        _refit(engine, _state(2), pool, manifest, with_info=False)
        assert all(torch.equal(model.weights[n], t) for n, t in _state(2).items())
        engine.update_weights(ColocatedUpdate(ColocatedStep.BEGIN,
                                              begin=ColocatedBegin(None)).to_wire())
        engine.update_weights(ColocatedUpdate(ColocatedStep.ABORT, reason="gone").to_wire())
        with pytest.raises(RefitError, match="without its refit info"):  # forgotten
            _refit(engine, _state(3), pool, manifest, with_info=False)


def test_the_driver_sends_each_worker_the_ipc_info_once_per_change():
    controls = [LocalWorkerControl(f"w{i}", {}) for i in range(2)]
    coordinator = RefitCoordinator(controls)

    def carried(info):
        return ["refit_info" in call.body for call in coordinator.ipc_stream_plan(info)]

    assert carried(INFO) == [True, True]
    assert carried(INFO) == [False, False]
    assert carried(OTHER) == [True, True]
    coordinator.updated(False)  # a failed update: every worker is sent it again
    assert carried(OTHER) == [True, True]
    coordinator.add_workers([LocalWorkerControl("w2", {})])
    assert carried(OTHER) == [False, False, True]
    assert RefitInfo.from_wire(coordinator.ipc_stream_plan(INFO)[0].body["refit_info"]) == INFO
