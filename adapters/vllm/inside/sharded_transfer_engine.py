"""The many-source sharded refit protocol as a vLLM weight-transfer engine, inside vLLM's worker.

Beside the packed engine (``transfer_engine.py``) and driven the same way (init -> start ->
update -> finish), with the same rollback and memory rules. Each engine rank joins the group
with every rank a data rank (the composition root's ``join_receiver``: the collective
adapter's sharded receiver), declares its engine's layout from the live vLLM model (workers x
tensor parallel E from the join and vLLM's parallel config, heads from the model's config,
and which tensors it must take whole: ``tp_slices.slice_targets``), learns the trainer's
layout from trainer rank 0, and receives only its rank's slice of each tensor. Each slice goes
through the model's own ``load_weights`` under vLLM's layerwise reload, its parameter told the
tensor comes cut (``tp_slices.mark_sliced``); the tensors taken whole (vocabulary-parallel
embeddings and lm_head, anything unmapped) are cut by vLLM's loaders as from a checkpoint, and
their bytes are reported as ``fallback_bytes`` in the rank's refit stats.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import attrs
from rollout_fleet.adapters.vllm.inside.tp_slices import (
    SliceTargets,
    cut_slice,
    mark_sliced,
    slice_targets,
    vllm_accepts,
)
from rollout_fleet.adapters.vllm.inside.transfer_engine import TransferEngine
from rollout_fleet.adapters.vllm.messages import PackedInitInfo, PackedUpdateInfo, ShardedRefitStats
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import GroupJoin, RefitInfo
from rollout_fleet.core.sharded_refit import EngineLayout, ShardedPlan
from rollout_fleet.ports.collective import SliceReceiver

log = logging.getLogger(__name__)


class ShardedTransferEngine(TransferEngine[SliceReceiver]):
    """Receives this rank's slices of a many-source sharded refit (``rollout-fleet-sharded-v1``)."""

    accepts = staticmethod(vllm_accepts)

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.join: GroupJoin | None = None
        self._targets: SliceTargets | None = None
        self._received = 0

    def init_transfer_engine(self, init_info: PackedInitInfo) -> None:
        pipeline = getattr(self.parallel_config, "pipeline_parallel_size", 1)
        if pipeline != 1:
            raise InvalidValue("pipeline_parallel_size", pipeline, "the sharded refit protocol"
                               " plans tensor-parallel slices only; use the packed protocol")
        super().init_transfer_engine(init_info)
        self.join = init_info.group_join

    def engine_layout(self, info: RefitInfo) -> tuple[EngineLayout, SliceTargets]:
        """This engine as the plan sees it, from the join and the live model (call it while a
        reload is in progress: the parameters are then the checkpoint-shaped ones), and what
        its parameters take cut."""
        join = self.join
        if join is None:
            raise RefitError("update_weights before init_transfer_engine")
        tp = getattr(self.parallel_config, "tensor_parallel_size", 1)
        workers = (join.world_size - join.train_world_size) // join.ranks_per_worker
        text = getattr(self.model_config, "hf_text_config", None) or getattr(
            self.model_config, "hf_config", None)
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        base = EngineLayout(workers, tp, heads, kv_heads)
        targets = slice_targets(self.model, info, base, self.accepts) if tp > 1 else \
            SliceTargets({}, ())
        return attrs.evolve(base, whole=targets.whole), targets

    def start_weight_update(self) -> None:
        super().start_weight_update()
        if self._targets is not None:  # a rollback's reload: the same parameters take slices
            mark_sliced(self.model, self._targets)

    def stream(self, receiver: SliceReceiver, info: RefitInfo) -> Iterator[tuple[str, Any]]:
        layout, self._targets = self.engine_layout(info)
        mark_sliced(self.model, self._targets)
        self._received = 0
        for name, tensor in receiver.receive_declared(info, layout):
            self._received += tensor.numel() * tensor.element_size()
            yield name, tensor

    def receive_weights(self, update_info: PackedUpdateInfo) -> None:
        super().receive_weights(update_info)
        plan, g = self.last_plan(), self.joined().engine_rank
        cuts = [plan.slice_of(g, t) for t in range(len(plan.info.tensors))]
        fallback = sum(c.nbytes for c in cuts if c.kind == "fallback")
        self.stats = ShardedRefitStats(
            **{**dataclasses.asdict(self.stats), "nbytes": self._received},
            planned_bytes=plan.receiver_bytes[g], received_bytes=self._received,
            fallback_bytes=fallback, full_bytes=plan.info.total_bytes,
            sliced_tensors=sum(c.kind in ("column", "row", "vocab") for c in cuts),
            whole_tensors=sum(c.kind == "fallback" for c in cuts))
        log.info("sharded refit on engine rank %d: %.1f MiB received of %.1f MiB in full"
                 " (%.1f MiB whole for want of a slice mapping: %s)", g, self._received / 2**20,
                 plan.info.total_bytes / 2**20, fallback / 2**20,
                 ", ".join(self._targets.whole) if self._targets else "none")

    def last_plan(self) -> ShardedPlan:
        plan = self.receiver.last_plan if self.receiver is not None else None
        if plan is None:
            raise RefitError("cannot roll back a sharded refit that never planned")
        return plan

    def checkpoint_weights(self) -> list[tuple[str, Any]]:
        """The model folder's weights, cut as the last plan cuts them for this rank."""
        plan, g = self.last_plan(), self.joined().engine_rank
        index = {m.name: t for t, m in enumerate(plan.info.tensors)}
        return [(name, cut_slice(tensor, plan.slice_of(g, index[name])) if name in index else tensor)
                for name, tensor in super().checkpoint_weights()]
