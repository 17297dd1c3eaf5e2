"""What asking vLLM for logprobs costs its front: CPU per 1,000 output tokens, and tokens/s.

An RL rollout needs each generated token's logprob; vLLM's own server under ``vllm bench
serve``, or the GRPO bench's ``"n": 8`` request, asks for none. vLLM's engine core sends each
request's logprobs every step as small arrays that its front (``AsyncLLM``: in a fleet worker
it runs in the worker's own process, on the main thread that also serves Dynamo's requests)
decodes and collects token by token. This bench measures that cost alone, on one bare
``AsyncLLM`` built with the fleet worker's engine arguments (``bench_gpu_fleet.Bare``), the same
load asked three ways, rounds interleaved:

  none:   no logprobs (what the GRPO bench's and the sweep's vLLM server is asked)
  dicts:  the chosen token's logprob in vLLM's default container (a dict and an object per token)
  flat:   the same in vLLM's flat lists (``flat_logprobs=True``: what the fleet's worker asks)

Load: ``--prompts`` prompts of ``--input-len`` random token IDs, ``--samples`` samples each
(vLLM's ``n``), ``--tokens`` new tokens, temperature 1.0, ``ignore_eos``; all sent at once,
every round and way prompts of its own (none in the engine's prefix cache from an earlier run).
Per way: median output tokens/s, this process's CPU ms per 1,000 output tokens (the front's
work) and its child processes' (vLLM's engine core and model worker: whether logprobs lengthen
the engine's own step loop), each with its ratio to "none"; each round prints every process's
cores and its busiest thread's share of the round (``process_load``: ~1.0 is a cap).

    .venv/bin/python bench/bench_logprobs_cost.py                   # the CPU, a small model
    python3 bench/bench_logprobs_cost.py --gpu --prompts 256 --input-len 1024 --samples 8 \\
        --tokens 256                                                # one GPU, 1B-class bf16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_gpu_fleet as gpu_fleet  # noqa: E402
from fresh_prompts import prompt_seed  # noqa: E402
from process_load import load_between, load_line, snapshot  # noqa: E402
from support.gpu_models import LLAMA_1B, SMALL, build_llama, random_prompts  # noqa: E402

WAYS = {"none": None, "dicts": False, "flat": True}  # way -> flat_logprobs (None: no logprobs)


def sampling_params(flat: bool | None, args, seed: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    logprobs = {} if flat is None else {"logprobs": 0, "flat_logprobs": flat}
    return SamplingParams(n=args.samples, temperature=1.0, seed=seed, max_tokens=args.tokens,
                          ignore_eos=True, detokenize=False, skip_clone=True,
                          output_kind=RequestOutputKind.FINAL_ONLY, **logprobs)


async def one(engine, prompt, params, request_id: str) -> int:
    """The output tokens of one request, every sample's logprobs read as the fleet reads them."""
    from rollout_fleet.adapters.vllm.host.convert import chosen_logprobs
    from vllm.inputs.engine import tokens_input

    final = None
    async for final in engine.generate(tokens_input(prompt), params, request_id):
        pass
    for sample in final.outputs:
        if params.logprobs is not None and \
                len(chosen_logprobs(sample.logprobs, sample.token_ids)) != len(sample.token_ids):
            raise SystemExit(f"{request_id}: not one logprob per token")
    return sum(len(sample.token_ids) for sample in final.outputs)


async def run_way(engine, prompts, way: str, args, tag: str) -> dict:
    before = snapshot([os.getpid()])  # this process (the front) and vLLM's engine processes
    cpu, started = time.process_time(), time.perf_counter()  # this process, every thread
    counts = await asyncio.gather(*(
        one(engine, prompt, sampling_params(WAYS[way], args, seed=index), f"{tag}-{index}")
        for index, prompt in enumerate(prompts)))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    after = snapshot([os.getpid()])
    tokens = sum(counts)
    if tokens != len(prompts) * args.samples * args.tokens:
        raise SystemExit(f"{way}: {tokens} output tokens, expected"
                         f" {len(prompts) * args.samples * args.tokens}")
    engine_cpu = sum(now["cpu_s"] - before["processes"].get(pid, {"cpu_s": 0.0})["cpu_s"]
                     for pid, now in after["processes"].items() if pid != os.getpid())
    return {"way": way, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "cpu_ms_per_1k_tokens": 1e6 * cpu / tokens,
            "engine_cpu_ms_per_1k_tokens": 1e6 * engine_cpu / tokens,
            "load": load_between(before, after)}


async def measure(args, work: Path) -> list[dict]:
    from rollout_fleet.wiring.config import parse_config

    shape, dtype = (LLAMA_1B, "bfloat16") if args.gpu else (SMALL, "float32")
    model = build_llama(work / "model", shape, dtype, seed=0,
                        max_positions=max(2048, args.max_model_len))

    # Every run its own prompts: none in the prefix cache from an earlier run.
    def drawn(*run, number: int = args.prompts) -> list[list[int]]:
        return random_prompts(number, args.input_len, shape["vocab_size"],
                              seed=prompt_seed(*run))

    kwargs = gpu_fleet.worker_engine_kwargs(parse_config(gpu_fleet.fleet_config(model, work, args)))
    print("engine arguments:", json.dumps(kwargs, default=str), flush=True)
    bare = await asyncio.to_thread(gpu_fleet.Bare, kwargs)
    records = []
    try:
        for way in WAYS:  # warm-up, not recorded
            await run_way(bare.engine, drawn("warm-up", way, number=8), way, args, f"warm-{way}")
        order = list(WAYS)
        for index in range(args.rounds):
            for way in order if index % 2 == 0 else order[::-1]:
                await asyncio.sleep(args.settle_s)
                record = {"round": index, **await run_way(bare.engine, drawn(way, index), way,
                                                          args, f"r{index}-{way}")}
                records.append(record)
                print(f"round {index} {way:>5}: {record['tokens_per_s']:,.0f} output tokens/s,"
                      f" CPU ms per 1k tokens: front {record['cpu_ms_per_1k_tokens']:.1f},"
                      f" engine {record['engine_cpu_ms_per_1k_tokens']:.1f}\n"
                      f"{load_line(record['load'])}", flush=True)
    finally:
        await bare.close()
    return records


def table(records: list[dict]) -> str:
    def median(way: str, key: str) -> float:
        return statistics.median(r[key] for r in records if r["way"] == way)

    lines = ["| asked | output tokens/s | / none | front CPU ms per 1k tokens | / none |"
             " engine CPU ms per 1k tokens | / none |", "|---|---:|---:|---:|---:|---:|---:|"]
    for way in WAYS:
        cells = [f"{median(way, 'tokens_per_s'):,.0f}",
                 f"{median(way, 'tokens_per_s') / median('none', 'tokens_per_s'):.2f}"]
        for key in ("cpu_ms_per_1k_tokens", "engine_cpu_ms_per_1k_tokens"):
            cells += [f"{median(way, key):.1f}", f"{median(way, key) / median('none', key):.2f}"]
        lines.append(f"| {way} | {' | '.join(cells)} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__)
    parser.add_argument("--gpu", action="store_true", help="one GPU, a 1B-class bf16 Llama")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="vLLM's n per prompt")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--out", type=Path, default=None, help="records.json and table.md here")
    args = parser.parse_args(argv)
    args.cpu = not args.gpu  # bench_gpu_fleet's fleet_config reads these three
    args.max_model_len = args.input_len + args.tokens
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-logprobs-") as work:
        records = asyncio.run(measure(args, Path(work)))
    text = table(records)
    print(f"\n{args.prompts} prompts x {args.input_len} tokens x {args.samples} samples x"
          f" {args.tokens} new tokens, {args.rounds} round(s), medians\n{text}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "records.json").write_text(json.dumps(records, indent=1))
        (args.out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
