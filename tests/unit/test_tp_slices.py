"""Which checkpoint tensors a tensor-parallel engine rank takes as pre-cut slices
(adapters/vllm/inside/tp_slices.py), on plain torch modules shaped as vLLM's Llama holds them
(fused qkv_proj and gate_up_proj, vocabulary-parallel embedding and lm_head): HF names map onto
the fused parameters, a fused checkpoint tensor, an unknown name, a layer that is not split
the plan's way, and the vocabulary-parallel tensors are taken whole; the rest are cut as vLLM's
loader cuts them. Also the protocol's configuration."""

from __future__ import annotations

import pytest
import torch

from rollout_fleet.adapters.vllm.inside.tp_slices import cut_slice, mark_sliced, slice_targets, vllm_target
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import RefitInfo, TensorMeta
from rollout_fleet.core.sharded_refit import EngineLayout, tensor_slice
from tests.unit.test_sharded_plan import reference_slice

HEADS, KV, HEAD_DIM, INTER, VOCAB, TP = 4, 2, 32, 96, 300, 2
HIDDEN = HEADS * HEAD_DIM
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class ParallelLinear(torch.nn.Module):
    """A linear layer's rank-local weight, split as ``kind`` says (column or row)."""

    def __init__(self, kind: str, rows: int, cols: int) -> None:
        super().__init__()
        self.kind = kind
        self.weight = torch.nn.Parameter(torch.empty(rows, cols))
        self.weight.tp_rank = 1


class Layer(torch.nn.Module):
    def __init__(self, kv_heads: int = KV) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.empty(HIDDEN))
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = ParallelLinear("column", (HEADS + 2 * kv_heads) * HEAD_DIM // TP, HIDDEN)
        self.self_attn.o_proj = ParallelLinear("row", HIDDEN, HIDDEN // TP)
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = ParallelLinear("column", 2 * INTER // TP, HIDDEN)
        self.mlp.down_proj = ParallelLinear("row", HIDDEN, INTER // TP)


class Model(torch.nn.Module):
    packed_modules_mapping = PACKED

    def __init__(self, second_layer_kv: int = KV) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB // TP, HIDDEN)
        self.model.layers = torch.nn.ModuleList([Layer(), Layer(second_layer_kv)])
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB // TP)


def accepts(module, param, tp):
    return module.kind if isinstance(module, ParallelLinear) and tp == TP else None


def checkpoint(fused_second_layer: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    for i in range(2):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = torch.randn(HIDDEN, generator=gen)
        if fused_second_layer and i == 1:
            state[f"{p}.self_attn.qkv_proj.weight"] = torch.randn((HEADS + 2 * KV) * HEAD_DIM, HIDDEN)
        else:
            for name, rows in (("q_proj", HEADS), ("k_proj", KV), ("v_proj", KV)):
                state[f"{p}.self_attn.{name}.weight"] = torch.randn(rows * HEAD_DIM, HIDDEN, generator=gen)
        state[f"{p}.self_attn.o_proj.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen)
        state[f"{p}.mlp.gate_proj.weight"] = torch.randn(INTER, HIDDEN, generator=gen)
        state[f"{p}.mlp.up_proj.weight"] = torch.randn(INTER, HIDDEN, generator=gen)
        state[f"{p}.mlp.down_proj.weight"] = torch.randn(HIDDEN, INTER, generator=gen)
    state["model.norm.weight"] = torch.randn(HIDDEN, generator=gen)
    state["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen)
    return state


def info_of(state):
    return RefitInfo(tuple(TensorMeta(n, tuple(t.shape), "float32") for n, t in state.items()))


LAYOUT = EngineLayout(1, TP, HEADS, KV)


def test_checkpoint_names_map_onto_the_fused_parameters():
    assert vllm_target("model.layers.0.self_attn.k_proj.weight", PACKED) == (
        "model.layers.0.self_attn.qkv_proj", "weight", False)
    assert vllm_target("model.layers.0.mlp.up_proj.weight", PACKED) == (
        "model.layers.0.mlp.gate_up_proj", "weight", False)
    assert vllm_target("model.layers.0.self_attn.qkv_proj.weight", PACKED)[2] is True
    assert vllm_target("model.layers.0.mlp.down_proj.weight", PACKED) == (
        "model.layers.0.mlp.down_proj", "weight", False)


def test_linear_parts_are_sliced_and_the_vocabulary_tensors_come_whole():
    state = checkpoint()
    targets = slice_targets(Model(), info_of(state), LAYOUT, accepts)
    assert targets.whole == ("model.embed_tokens.weight", "lm_head.weight")
    linear = [n for n in state if "proj" in n]
    assert sorted(targets.params) == sorted(linear)
    assert targets.params["model.layers.1.self_attn.v_proj.weight"] == (
        "model.layers.1.self_attn.qkv_proj", "weight")
    # Every rank's slices, concatenated per parameter, fill that rank's shard exactly, and
    # each is what vLLM's loader keeps of the full tensor.
    layout = EngineLayout(1, TP, HEADS, KV, targets.whole)
    for rank in range(TP):
        for meta in info_of(state).tensors:
            cut = tensor_slice(meta, layout, rank)
            want = state[meta.name] if meta.name in targets.whole else reference_slice(
                state[meta.name], meta.name, TP, rank, HEADS, KV, HEAD_DIM)
            assert torch.equal(cut_slice(state[meta.name], cut), want), (meta.name, rank)


def test_a_fused_checkpoint_tensor_an_unknown_name_and_a_misfit_layer_come_whole():
    state = checkpoint(fused_second_layer=True)
    state["model.layers.0.self_attn.rotary.extra.weight"] = torch.randn(4, HIDDEN)
    info = info_of(state)
    targets = slice_targets(Model(), info, LAYOUT, accepts)
    assert "model.layers.1.self_attn.qkv_proj.weight" in targets.whole  # the loader splits it
    assert "model.layers.0.self_attn.rotary.extra.weight" not in targets.params
    # A layer whose shard is not the plan's split (1 KV head per rank here, 2 in the model):
    # all three parts of its qkv_proj come whole rather than mis-filled.
    misfit = slice_targets(Model(second_layer_kv=4), info_of(checkpoint()), LAYOUT, accepts)
    assert {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"} <= set(misfit.whole)
    assert "model.layers.0.self_attn.q_proj.weight" in misfit.params


def test_marking_tells_each_sliced_parameter_its_tensors_come_cut():
    model = Model()
    targets = slice_targets(model, info_of(checkpoint()), LAYOUT, accepts)
    mark_sliced(model, targets)
    weight = model.model.layers[0].self_attn.qkv_proj.weight
    assert weight.tp_rank == 0 and weight.is_sharded_weight is True
    assert not hasattr(model.model.embed_tokens.weight, "is_sharded_weight")


def test_the_sharded_protocol_is_a_cpu_refit_protocol_and_a_wrong_name_is_refused():
    from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig
    from rollout_fleet.core.refit import RefitProtocol
    from rollout_fleet.wiring.config import parse_config

    engine = VllmEngineConfig(model="/m", tensor_parallel_size=2, refit_protocol=RefitProtocol.SHARDED)
    assert engine.engine_kwargs()["weight_transfer_config"] == {"backend": "rollout_fleet_sharded"}
    fleet = parse_config({"engine": {"kind": "vllm", "refit_protocol": "rollout-fleet-sharded-v1"}})
    assert fleet.sender_spec.protocol is RefitProtocol.SHARDED
    with pytest.raises(InvalidValue, match="refit_protocol.*sharded.*must be one of"):
        VllmEngineConfig(model="/m", refit_protocol="sharded")
