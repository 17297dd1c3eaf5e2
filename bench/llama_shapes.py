"""Llama-style parameter shapes shared by the refit benchmarks (HF checkpoint names)."""

from __future__ import annotations


def layer_shapes(index: int, hidden: int, inter: int, kv: int) -> dict[str, tuple[int, ...]]:
    """One decoder layer's parameters: attention (``kv`` = KV heads x head dim) and MLP."""
    p = f"model.layers.{index}."
    return {
        p + "input_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (hidden, hidden),
        p + "self_attn.k_proj.weight": (kv, hidden),
        p + "self_attn.v_proj.weight": (kv, hidden),
        p + "self_attn.o_proj.weight": (hidden, hidden),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
    }
