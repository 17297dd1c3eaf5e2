"""The refit floor of the sharded protocol against the packed one, from the plan itself.

For Llama-shaped models and fleet layouts, the bytes the sharded plan (core/sharded_refit.py)
puts into the busiest engine rank and out of the busiest trainer rank, beside the packed
protocol's (one sender, every engine rank the whole model), and the part of a rank's bytes
that comes whole because vLLM's loader for it takes no pre-cut slice (the vocabulary-parallel
embedding and lm_head: what the engine declares as ``whole``). The floor over links of
bandwidth B: time >= max(bytes into any one receiver, bytes out of any one sender) / B, so the
ratio printed is the sharded floor over the packed floor. Pure arithmetic: no transfer runs.

    .venv/bin/python bench/bench_sharded_floor.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llama_shapes import layer_shapes  # noqa: E402
from rollout_fleet.core.refit import RefitInfo, TensorMeta  # noqa: E402
from rollout_fleet.core.sharded_refit import (  # noqa: E402
    EngineLayout,
    TrainerLayout,
    plan_sharded_refit,
)

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
# name: (vocab, hidden, heads, kv heads, layers, intermediate, dtype)
MODELS = {
    "tiny TP-2 test model": (512, 256, 4, 2, 2, 512, "float32"),
    "TP-2 fleet test model": (1024, 1024, 8, 4, 3, 4608, "float32"),
    "Llama-3-8B shape": (128256, 4096, 32, 8, 32, 14336, "bfloat16"),
}
LAYOUTS = {"tiny TP-2 test model": [(2, 1, 2)], "TP-2 fleet test model": [(2, 1, 2)],
           "Llama-3-8B shape": [(8, 2, 4), (8, 1, 8), (16, 4, 2)]}  # (T, W, E)


def model_info(vocab, hidden, heads, kv, layers, inter, dtype) -> RefitInfo:
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for index in range(layers):
        shapes.update(layer_shapes(index, hidden, inter, kv * (hidden // heads)))
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return RefitInfo(tuple(TensorMeta(n, s, dtype) for n, s in shapes.items()))


def main() -> int:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"{'model':24} {'T':>3} {'W':>2} {'E':>2} {'model MiB':>10} {'max in MiB':>11}"
          f" {'of it whole':>11} {'max out MiB':>11} {'sharded/packed floor':>21}")
    for name, shape in MODELS.items():
        info = model_info(*shape)
        for trainers, workers, tp in LAYOUTS[name]:
            layout = TrainerLayout.fsdp(info, trainers, replicated=lambda meta: "norm" in meta.name)
            engine = EngineLayout(workers, tp, shape[2], shape[3], VOCAB_TENSORS)
            plan = plan_sharded_refit(info, layout, engine, 1 << 30)
            into, out = max(plan.receiver_bytes), max(plan.sender_bytes)
            whole = plan.fallback_bytes / engine.engine_ranks
            print(f"{name:24} {trainers:>3} {workers:>2} {tp:>2} {info.total_bytes / 2**20:>10.1f}"
                  f" {into / 2**20:>11.1f} {whole / 2**20:>11.1f} {out / 2**20:>11.1f}"
                  f" {max(into, out) / info.total_bytes:>21.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
