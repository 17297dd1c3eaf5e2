"""Rollout tokens/s through the Dynamo frontend vs the same vLLM engine called directly.

One run, one engine: this process hosts a VllmEngine on the tiny model, serves it through
Dynamo (``start_dynamo_endpoint``, in this process's loop) behind a real ``dynamo.frontend``
child process, and times the same batch of rollouts both ways, in alternating rounds:

  direct:   ``serve_rollout`` on the adapter, all prompts at once (asyncio.gather)
  frontend: the same rollouts as ``/v1/completions`` requests, sent by a client process of
            its own (as a trainer's driver is: its HTTP work must not run on the engine's
            loop) over one pooled aiohttp session, as many connections as prompts, warmed
            before the timed batch, parsed back into ServedRollout

Shapes: 64 prompts x 32 new tokens, and 256 prompts x 64 new tokens (16-token prompts, seeded
sampling so both ways generate the very same tokens, checked). Prints tokens/s per round, and
frontend/direct on the medians and on each way's best round (on a shared machine other
processes only take throughput away). Target: >= 0.85. Each frontend round also prints its
admission: when, after the client started the batch, the engine saw the first, the median and
the last rollout arrive (every request is written to its socket within a few milliseconds).

    .venv/bin/python bench/bench_vllm_frontend.py [--rounds 5] [--shapes 64x32 256x64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DYN_LOG", "warn")  # read once, when Dynamo's runtime loads: info logs every request

SERVED_MODEL = "tiny-vllm-bench"
PROMPT_TOKENS = 16


def make_requests(count: int, new_tokens: int, tag: str):
    import random

    from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec

    rng = random.Random(count * 1000 + new_tokens)
    return [RolloutRequest(request_id=f"{tag}-{i}", max_new_tokens=new_tokens,
                           prompt_token_ids=[rng.randrange(3, 512) for _ in range(PROMPT_TOKENS)],
                           sampling=SamplingSpec(greedy=False, temperature=1.0, seed=i))
            for i in range(count)]


async def run_direct(engine, requests) -> tuple[float, int, list]:
    start = time.perf_counter()
    served = await asyncio.gather(*(engine.serve_rollout(
        r.prompt_token_ids, request_id=r.request_id, max_new_tokens=r.max_new_tokens,
        sampling=r.sampling, stop_strings=r.stop_strings) for r in requests))
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(s.token_ids) for s in served), served


async def post_all(session, url: str, requests) -> list:
    from rollout_fleet.core.wire import completion_body, parse_completion_answer

    async def one(request):
        async with session.post(f"{url}/v1/completions",
                                json=completion_body(request, SERVED_MODEL)) as answer:
            body = await answer.read()
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {body[:300]!r}")
            return parse_completion_answer(body)

    return await asyncio.gather(*(one(r) for r in requests))


async def client_main(url: str, count: int, new_tokens: int, tag: str) -> None:
    """The frontend way's client, in a process of its own (as a trainer's driver would be):
    warm the connection pool, then time one batch; print elapsed seconds and the tokens."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await post_all(session, url, make_requests(count, 1, f"pool-{tag}"))
        requests = make_requests(count, new_tokens, tag)
        started_at = time.time()  # wall clock: the engine's process stamps arrivals with it
        start = time.perf_counter()
        served = await post_all(session, url, requests)
        elapsed = time.perf_counter() - start
    print(json.dumps({"elapsed": elapsed, "started_at": started_at,
                      "tokens": [list(s.token_ids) for s in served]}))


async def run_frontend(url: str, count: int, new_tokens: int, tag: str) -> tuple[float, int, list]:
    child = await asyncio.create_subprocess_exec(  # this session: see adapters/dynamo/frontend.py
        sys.executable, __file__, "--client", url, str(count), str(new_tokens), tag,
        stdout=asyncio.subprocess.PIPE, process_group=0)
    out, _ = await child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"the client process failed with code {child.returncode}")
    answer = json.loads(out.decode().strip().splitlines()[-1])
    tokens = [tuple(t) for t in answer["tokens"]]
    return answer["elapsed"], sum(len(t) for t in tokens), tokens, answer["started_at"]


class ArrivalClock:
    """Wall-clock time at which each rollout reached the engine, by request id."""

    def __init__(self, engine) -> None:
        self.arrived: dict[str, float] = {}
        serve = engine.serve_rollout

        async def stamped(*args, **kwargs):
            self.arrived[kwargs["request_id"]] = time.time()
            return await serve(*args, **kwargs)

        engine.serve_rollout = stamped

    def admission(self, tag: str, started_at: float) -> str:
        delays = sorted(t - started_at for rid, t in self.arrived.items()
                        if rid.startswith(f"{tag}-"))
        return (f"engine saw the first after {delays[0]:.3f} s, the median after "
                f"{delays[len(delays) // 2]:.3f} s, the last after {delays[-1]:.3f} s")


async def measure(engine, url: str, shapes, rounds: int) -> list[str]:
    clock = ArrivalClock(engine)
    lines = []
    for count, new_tokens in shapes:
        await run_direct(engine, make_requests(count, new_tokens, f"warm-{count}"))
        rates = {"direct": [], "frontend": []}
        for round_index in range(rounds):
            order = ["direct", "frontend"] if round_index % 2 == 0 else ["frontend", "direct"]
            answers = {}
            for way in order:
                tag = f"{way}-{count}-{round_index}"
                if way == "direct":
                    elapsed, tokens, served = await run_direct(
                        engine, make_requests(count, new_tokens, tag))
                    answers[way] = [s.token_ids for s in served]
                    admission = ""
                else:
                    elapsed, tokens, answers[way], started_at = await run_frontend(
                        url, count, new_tokens, tag)
                    admission = f"; {clock.admission(tag, started_at)}"
                rates[way].append(tokens / elapsed)
                print(f"  {count}x{new_tokens} round {round_index} {way:8s}: {tokens} tokens "
                      f"in {elapsed:.2f} s = {tokens / elapsed:,.0f} tokens/s{admission}", flush=True)
            if answers["direct"] != answers["frontend"]:
                raise AssertionError(f"{count}x{new_tokens}: the two ways generated different tokens")
        direct, front = statistics.median(rates["direct"]), statistics.median(rates["frontend"])
        best_direct, best_front = max(rates["direct"]), max(rates["frontend"])
        lines.append(f"{count} prompts x {new_tokens} tokens: medians direct {direct:,.0f} tokens/s, "
                     f"frontend {front:,.0f} tokens/s, frontend/direct = {front / direct:.3f}; "
                     f"best runs {best_direct:,.0f} vs {best_front:,.0f} = "
                     f"{best_front / best_direct:.3f} (target >= 0.85)")
    return lines


async def bench(run_dir: Path, shapes, rounds: int) -> list[str]:
    from rollout_fleet.adapters.dynamo import DynamoEngineAdapter, DynamoFrontend, start_dynamo_endpoint
    from rollout_fleet.adapters.dynamo.env import dynamo_env
    from rollout_fleet.adapters.tiny_model import build_tiny_model
    from rollout_fleet.adapters.vllm import VllmEngine, VllmEngineConfig
    from tests.support import free_port

    model = build_tiny_model(run_dir / "model", seed=0)
    engine = VllmEngine(VllmEngineConfig(model=str(model)))
    frontend = DynamoFrontend(run_dir, http_port=free_port()).start()
    serving = None
    try:
        env = dynamo_env(run_dir)
        Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
        serving = start_dynamo_endpoint(DynamoEngineAdapter(engine), model_path=str(model),
                                        served_model_name=SERVED_MODEL, namespace="bench",
                                        engine_env=env)
        await asyncio.to_thread(frontend.wait_for_model, SERVED_MODEL, 300.0)
        return await measure(engine, frontend.url, shapes, rounds)
    finally:
        frontend.stop()
        if serving is not None:
            signal.raise_signal(signal.SIGTERM)  # Dynamo's worker stops only on SIGTERM
            await asyncio.wait([serving], timeout=30)
        await engine.close()


def parse_shape(text: str) -> tuple[int, int]:
    count, _, tokens = text.partition("x")
    return int(count), int(tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=["64x32", "256x64"])
    parser.add_argument("--client", nargs=4, metavar=("URL", "COUNT", "TOKENS", "TAG"),
                        help=argparse.SUPPRESS)  # internal: the frontend way's client process
    args = parser.parse_args(argv)
    if args.client:
        url, count, tokens, tag = args.client
        asyncio.run(client_main(url, int(count), int(tokens), tag))
        return 0
    # Installed before Dynamo's, which runs first and then calls this one (see endpoint.py).
    signal.signal(signal.SIGTERM, lambda *_: None)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-frontend-") as run_dir:
        lines = asyncio.run(bench(Path(run_dir), [parse_shape(s) for s in args.shapes], args.rounds))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
