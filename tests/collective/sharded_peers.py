"""Ranks of a many-source sharded refit as processes: trainer ranks holding dim-0 shards of a
Llama-style model (fused qkv and gate_up, a tied embedding, replicated norms), engine ranks
checking every slice they receive against the slice vLLM's loader cuts from the full tensor."""

from __future__ import annotations

import os
from typing import Any

import torch

from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo, TensorMeta
from rollout_fleet.core.sharded_refit import EngineLayout, TrainerLayout
from tests.collective.peers import HOST, _outcome

HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 4, 2, 24, 160, 250, 2
HIDDEN = HEADS * HEAD_DIM
SPEC = CollectiveSenderSpec(buffer_bytes=64 << 10, num_buffers=2)


def model_state(seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint names; the embedding is tied (no lm_head)."""
    gen = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = torch.randn(HIDDEN, generator=gen)
        state[f"{p}.self_attn.qkv_proj.weight"] = torch.randn(
            (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, generator=gen)
        state[f"{p}.self_attn.o_proj.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen)
        state[f"{p}.post_attention_layernorm.weight"] = torch.randn(HIDDEN, generator=gen)
        state[f"{p}.mlp.gate_up_proj.weight"] = torch.randn(2 * INTER, HIDDEN, generator=gen)
        state[f"{p}.mlp.down_proj.weight"] = torch.randn(HIDDEN, INTER, generator=gen)
    state["model.norm.weight"] = torch.randn(HIDDEN, generator=gen)
    return state


def declarations(train_world_size: int, workers: int, tp: int):
    state = model_state(0)
    info = RefitInfo(tuple(TensorMeta(n, tuple(t.shape), "float32") for n, t in state.items()))
    layout = TrainerLayout.fsdp(info, train_world_size, replicated=lambda m: "norm" in m.name)
    return info, layout, EngineLayout(workers, tp, HEADS, KV_HEADS)


def local_shards(state, layout: TrainerLayout, info: RefitInfo, rank: int):
    local = {}
    for meta, rows in zip(info.tensors, layout.rows):
        full = state[meta.name]
        start = 0 if rows is None else sum(rows[:rank])
        local[meta.name] = full if rows is None else full[start:start + rows[rank]].clone()
    return local


def _dtensors(state, mesh):
    """The same shards, cut by DTensor itself (Shard(0); the norms Replicate())."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {name: distribute_tensor(t, mesh, [Replicate() if "norm" in name else Shard(0)])
            for name, t in state.items()}


def _trainer_mesh(train_world_size: int, rank: int, port: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank,
                            world_size=train_world_size)
    return init_device_mesh("cpu", (train_world_size,))


def trainer(port: int, rank: int, world_size: int, *, train_world_size: int, workers: int,
            tp: int, seeds: list[int], dtensor_port: int | None = None) -> dict[str, Any]:
    def run():
        import torch.distributed as dist

        from rollout_fleet.adapters.collective.sharded_trainer import ShardedTrainerSession

        info, layout, engine = declarations(train_world_size, workers, tp)
        mesh = _trainer_mesh(train_world_size, rank, dtensor_port) if dtensor_port else None
        sent = []
        try:
            with ShardedTrainerSession(HOST, port, rank, world_size,
                                       train_world_size=train_world_size,
                                       engine=engine if rank < 2 else None, spec=SPEC,
                                       timeout_s=60) as session:
                for seed in seeds:
                    state = model_state(seed)
                    dtensors = _dtensors(state, mesh) if mesh is not None else None
                    if dtensors is not None and rank % 2:  # odd ranks hand over DTensors
                        plan = session.send_dtensor_state_dict(dtensors)
                    else:
                        plan = session.send_shards(info, layout,
                                                   local_shards(state, layout, info, rank))
                    sent.append(plan.sender_bytes[rank])
        finally:
            if mesh is not None:
                dist.destroy_process_group()
        return {"sent_bytes": sent}
    return _outcome(run)


def engine_rank(port: int, rank: int, world_size: int, *, train_world_size: int, workers: int,
                tp: int, seeds: list[int], declared_tp: int | None = None) -> dict[str, Any]:
    def run():
        from rollout_fleet.adapters.collective.sharded_trainer import join_sharded_receiver
        from rollout_fleet.core.refit import GroupJoin
        from tests.unit.test_sharded_plan import reference_slice

        info, _, engine = declarations(train_world_size, workers, declared_tp or tp)
        g = rank - train_world_size
        join = GroupJoin(host=HOST, port=port, world_size=world_size,
                         train_world_size=train_world_size, first_rank=train_world_size + g // tp * tp,
                         ranks_per_worker=tp, sender_spec=SPEC, timeout_s=60, backend="gloo")
        receiver = join_sharded_receiver(join, g % tp)
        report = []
        try:
            for seed in seeds:
                state, mismatched, names, peak = model_state(seed), [], [], 0
                for name, got in receiver.receive_declared(info, engine):
                    want = reference_slice(state[name], name, tp, g % tp, HEADS, KV_HEADS, HEAD_DIM)
                    if got.shape != want.shape or not torch.equal(got, want):
                        mismatched.append(name)
                    names.append(name)
                    peak = max(peak, receiver.account.live_bytes)
                    del got
                plan = receiver.last_plan
                report.append({"names": names, "mismatched": mismatched, "peak": peak,
                               "planned_bytes": plan.receiver_bytes[g],
                               "bound": SPEC.num_buffers * plan.block_bytes[g]})
        finally:
            receiver.close()
        return {"refits": report, "pid": os.getpid()}
    return _outcome(run)
