"""What streaming a rollout would cost the worker: one final answer vs a piece per engine step.

One ``VllmEngine`` (the tiny model the project builds, the fleet's engine arguments), the same
seeded rollouts both ways, rounds interleaved:

  final:   ``serve_rollout`` (vLLM's FINAL_ONLY outputs), the rollout path today;
  stream:  ``stream_rollout`` consumed piece by piece (vLLM's DELTA outputs), the plain OpenAI
           path; the pieces are joined into the same tokens (checked).

Prints tokens/s per round and stream / final on the medians. This is the engine side only:
through Dynamo a streamed rollout would also send a chunk per token instead of one.

    unshare -n sh -c 'ip link set lo up && .venv/bin/python bench/bench_stream_rollout.py \
        [--rounds 3] [--prompts 256] [--new-tokens 64]'
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def final_way(engine, prompts, new_tokens, tag):
    from rollout_fleet.core.rollout import SamplingSpec

    served = await asyncio.gather(*(engine.serve_rollout(
        prompt, request_id=f"{tag}-{i}", max_new_tokens=new_tokens,
        sampling=SamplingSpec(greedy=False, seed=i)) for i, prompt in enumerate(prompts)))
    return [s.token_ids for s in served]


async def stream_way(engine, prompts, new_tokens, tag):
    from rollout_fleet.core.rollout import SamplingSpec

    async def one(i, prompt):
        tokens = []
        async for piece in engine.stream_rollout(prompt, request_id=f"{tag}-{i}",
                                                 max_new_tokens=new_tokens,
                                                 sampling=SamplingSpec(greedy=False, seed=i)):
            tokens.extend(piece.token_ids)
        return tuple(tokens)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def bench(args) -> list[str]:
    from rollout_fleet.adapters.tiny_model import build_tiny_model
    from rollout_fleet.adapters.vllm.host import VllmEngine, VllmEngineConfig

    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-stream-")) / "model", seed=0)
    engine = VllmEngine(VllmEngineConfig(model=str(model)))
    await engine.start(0)
    prompts = [[5 + (i * 7 + j) % 500 for j in range(16)] for i in range(args.prompts)]
    ways = {"final": final_way, "stream": stream_way}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for way, run in ways.items():  # warm both
            await run(engine, prompts[:32], args.new_tokens, f"warm-{way}")
        for index in range(args.rounds):
            order = list(ways) if index % 2 == 0 else list(ways)[::-1]
            answers = {}
            for way in order:
                started = time.perf_counter()
                answers[way] = await ways[way](engine, prompts, args.new_tokens, f"{way}-{index}")
                rate = sum(map(len, answers[way])) / (time.perf_counter() - started)
                rates[way].append(rate)
                print(f"round {index} {way:>6}: {rate:,.0f} tokens/s", flush=True)
            assert list(answers["final"]) == list(answers["stream"]), "the ways disagree"
    finally:
        await engine.close()
    final, stream = (statistics.median(rates[w]) for w in ways)
    return [f"final {final:,.0f} tokens/s, stream {stream:,.0f} tokens/s (medians of "
            f"{args.rounds}): stream / final {stream / final:.2f}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    print("\n".join(asyncio.run(bench(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
