"""Rollout tokens/s through the fleet vs bare vLLM on the same engine arguments.

One run, the tiny model the project builds, the same prompts and the same sampling both ways:

  direct:   bare vLLM, no project code on the path: ``AsyncLLM.from_engine_args`` on the very
            keyword arguments ``VllmEngineConfig(model=...).engine_kwargs()`` builds, every
            prompt at once through ``AsyncLLM.generate`` (asyncio.gather), with the sampling
            parameters the fleet's engine asks for (seeded sampling, the chosen token's
            logprob, final output only, no detokenizing)
  fleet:    the project's path: a ``VllmEngine`` served through Dynamo
            (``start_dynamo_endpoint``, in this process's loop) behind a real ``dynamo.frontend``
            child process; the rollouts go as ``/v1/completions`` requests from a client
            process of its own (as a trainer's driver is: its HTTP work must not run on the
            engine's loop) over one pooled aiohttp session, as many connections as prompts,
            warmed before the timed batch, parsed back into ServedRollout

Each vLLM CPU engine takes ~2.2 GB. ``--layout interleaved`` holds both engines at once and
alternates the ways round by round (the fair comparison on a machine whose load drifts);
``--layout sequential`` (the default, for a shared machine short of memory) runs every round
of bare vLLM, stops it, then every round of the fleet. The fleet's engine runs its vLLM
processes niced (``VllmEngineConfig.cpu_worker_nice``), bare vLLM at normal priority: on a
loaded machine that alone takes throughput from the fleet's side. Either way the two must generate the
very same tokens for every prompt of every round (checked).

Shapes: 64 prompts x 32 new tokens, and 256 prompts x 64 new tokens (16-token prompts). Prints
tokens/s per round, and fleet/direct on the medians and on each way's best round (on a shared
machine other processes only take throughput away). Target: >= 0.9. Each fleet round also
prints its admission: when, after the client started the batch, the engine saw the first, the
median and the last rollout arrive. Every round also prints the CPU seconds each process
spent (``CpuMeter``: this process, vLLM's engine core, the frontend, the client), and the
summary gives their medians per 1,000 tokens for each way: on 2 cores, CPU that the frontend,
the client and the worker's glue use is CPU the engine core does not get.

    .venv/bin/python bench/bench_vllm_frontend.py [--rounds 5] [--shapes 64x32 256x64]
        [--layout sequential|interleaved]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
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
WAYS = ("direct", "fleet")
SHUTDOWN_TIMEOUT_S = 30.0
# vLLM's engine core busy-polls for about a second after its last step: with both engines up,
# the way that just ran would take cores from the next one without this pause.
QUIET_BETWEEN_WAYS_S = 1.5


def make_prompts(count: int, new_tokens: int) -> list[list[int]]:
    import random

    rng = random.Random(count * 1000 + new_tokens)
    return [[rng.randrange(3, 512) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def make_requests(count: int, new_tokens: int, tag: str):
    from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec

    return [RolloutRequest(request_id=f"{tag}-{i}", max_new_tokens=new_tokens, prompt_token_ids=p,
                           sampling=SamplingSpec(greedy=False, temperature=1.0, seed=i))
            for i, p in enumerate(make_prompts(count, new_tokens))]


# -- direct: bare vLLM ----------------------------------------------------------------------------
class BareVllm:
    """vLLM's AsyncLLM and nothing else; only its engine arguments come from the project."""

    def __init__(self, engine_kwargs: dict) -> None:
        from vllm.config import KVEventsConfig, WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(engine_kwargs)  # vLLM wants these two as its config objects, not dicts
        if "kv_events_config" in kwargs:
            kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
        if "weight_transfer_config" in kwargs:
            kwargs["weight_transfer_config"] = WeightTransferConfig(**kwargs["weight_transfer_config"])
        from rollout_fleet.adapters.vllm.host.runtime import serving_usage_context

        from rollout_fleet.adapters.vllm.host.process import ipc_environment, scoped_environment

        # built as the fleet's worker builds its engine (the same batch limits), its socket
        # files in a folder of its own (removed at close)
        self.ipc_folder, ipc_env = ipc_environment()
        with scoped_environment(ipc_env):
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs),
                                                    usage_context=serving_usage_context())

    async def one(self, prompt: list[int], request_id: str, new_tokens: int, seed: int):
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=seed, max_tokens=new_tokens,
                                logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for final in self.engine.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                                request_id):
            pass
        return tuple(final.outputs[0].token_ids)

    async def run(self, count: int, new_tokens: int, tag: str) -> tuple[float, list]:
        prompts = make_prompts(count, new_tokens)
        start = time.perf_counter()
        tokens = await asyncio.gather(*(self.one(p, f"{tag}-{i}", new_tokens, seed=i)
                                        for i, p in enumerate(prompts)))
        return time.perf_counter() - start, tokens, ""

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        handler = engine.output_handler
        if handler is not None:  # first, or it reports the engine core's exit as an error
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        # Room for the engine core's teardown: killed at vLLM's default (on a busy host) it
        # leaves its shared-memory queues behind in /dev/shm.
        await asyncio.to_thread(engine.shutdown, SHUTDOWN_TIMEOUT_S)
        del engine
        gc.collect()  # now: a late __del__ at interpreter exit would shut the engine down twice
        if self.ipc_folder is not None:
            shutil.rmtree(self.ipc_folder, ignore_errors=True)


# -- fleet: frontend + worker + the project's VllmEngine -----------------------------------------
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
    """The fleet way's client, in a process of its own (as a trainer's driver would be):
    warm the connection pool, then time one batch; print elapsed seconds and the tokens."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await post_all(session, url, make_requests(count, 1, f"pool-{tag}"))
        requests = make_requests(count, new_tokens, tag)
        started_at = time.time()  # wall clock: the engine's process stamps arrivals with it
        start, cpu_start = time.perf_counter(), time.process_time()
        served = await post_all(session, url, requests)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"elapsed": elapsed, "started_at": started_at, "cpu_s": cpu,
                      "tokens": [list(s.token_ids) for s in served]}))


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
        return (f"; engine saw the first after {delays[0]:.3f} s, the median after "
                f"{delays[len(delays) // 2]:.3f} s, the last after {delays[-1]:.3f} s")


class Fleet:
    def __init__(self, run_dir: Path, config) -> None:
        from rollout_fleet.adapters.dynamo import DynamoFrontend
        from rollout_fleet.adapters.vllm.host import VllmEngine
        from rollout_fleet.adapters.shared import free_port

        self.run_dir, self.config = run_dir, config
        self.engine = VllmEngine(config)
        self.frontend = DynamoFrontend(run_dir, http_port=free_port())
        self.serving = None
        self.clock = ArrivalClock(self.engine)
        self.client_cpu_s = 0.0  # the last timed batch's, as its process measured it

    async def start(self) -> "Fleet":
        from rollout_fleet.adapters.dynamo import DynamoEngineAdapter, start_dynamo_endpoint
        from rollout_fleet.adapters.dynamo.env import dynamo_env

        self.frontend.start()
        env = dynamo_env(self.run_dir)
        Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
        self.serving = start_dynamo_endpoint(DynamoEngineAdapter(self.engine),
                                             model_path=self.config.model,
                                             served_model_name=SERVED_MODEL, namespace="bench",
                                             engine_env=env)
        await asyncio.to_thread(self.frontend.wait_for_model, SERVED_MODEL, 300.0)
        return self

    async def run(self, count: int, new_tokens: int, tag: str) -> tuple[float, list, str]:
        child = await asyncio.create_subprocess_exec(  # this session: see adapters/dynamo/frontend.py
            sys.executable, __file__, "--client", self.frontend.url, str(count), str(new_tokens),
            tag, stdout=asyncio.subprocess.PIPE, process_group=0)
        out, _ = await child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"the client process failed with code {child.returncode}")
        answer = json.loads(out.decode().strip().splitlines()[-1])
        self.client_cpu_s = answer["cpu_s"]
        return (answer["elapsed"], [tuple(t) for t in answer["tokens"]],
                self.clock.admission(tag, answer["started_at"]))

    async def close(self) -> None:
        self.frontend.stop()
        if self.serving is not None:
            signal.raise_signal(signal.SIGTERM)  # Dynamo's worker stops only on SIGTERM
            await asyncio.wait([self.serving], timeout=30)
        await self.engine.close()


# -- measuring --------------------------------------------------------------------------------------
PARTS = ("caller/host", "engine core", "frontend", "client")


class CpuMeter:
    """CPU seconds (user + system) of each process of one way over one round.

    caller/host: this process. For bare vLLM it is the caller and vLLM's AsyncLLM front; for
    the fleet it is the worker's host process: Dynamo's runtime and glue, the project's engine
    adapter and the same AsyncLLM front. engine core: vLLM's engine-core processes (children of
    this one). frontend: Dynamo's frontend process (the fleet only). client: the fleet's HTTP
    client process, as it measured its timed batch (bare vLLM has none).
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()

    def snapshot(self, frontend_pid: int | None) -> dict[str, float]:
        frontend = set()
        if frontend_pid is not None:
            with contextlib.suppress(self._psutil.Error):
                root = self._psutil.Process(frontend_pid)
                frontend = {root, *root.children(recursive=True)}
        frontend_pids = {p.pid for p in frontend}
        engine = [c for c in self._me.children(recursive=True) if c.pid not in frontend_pids]
        return {"caller/host": self._cpu(self._me), "engine core": sum(map(self._cpu, engine)),
                "frontend": sum(map(self._cpu, frontend))}

    def _cpu(self, process) -> float:
        try:
            times = process.cpu_times()
        except self._psutil.Error:  # gone since it was listed
            return 0.0
        return times.user + times.system


class Tally:
    def __init__(self, shapes) -> None:
        self.rates = {(shape, way): [] for shape in shapes for way in WAYS}
        self.tokens: dict[tuple, list] = {}  # (shape, round, way) -> tokens per prompt
        self.cpu = {(shape, way): [] for shape in shapes for way in WAYS}  # ms per 1k tokens
        self.meter = CpuMeter()

    async def round(self, runner, way: str, shape, round_index: int) -> None:
        count, new_tokens = shape
        frontend_pid = runner.frontend.process.pid if way == "fleet" else None
        before = self.meter.snapshot(frontend_pid)
        elapsed, tokens, note = await runner.run(count, new_tokens, f"{way}-{count}-{round_index}")
        after = self.meter.snapshot(frontend_pid)
        total = sum(len(t) for t in tokens)
        spent = {part: after[part] - before[part] for part in after}
        spent["client"] = runner.client_cpu_s if way == "fleet" else 0.0
        self.cpu[shape, way].append({part: 1e6 * spent[part] / total for part in PARTS})
        note += "; CPU s " + ", ".join(f"{part} {spent[part]:.2f}" for part in PARTS)
        self.rates[shape, way].append(total / elapsed)
        self.tokens[shape, round_index, way] = tokens
        print(f"  {count}x{new_tokens} round {round_index} {way:6s}: {total} tokens in {elapsed:.2f} s"
              f" = {total / elapsed:,.0f} tokens/s{note}", flush=True)
        other = self.tokens.get((shape, round_index, "fleet" if way == "direct" else "direct"))
        if other is not None and other != tokens:
            raise AssertionError(f"{count}x{new_tokens} round {round_index}: bare vLLM and the "
                                 "fleet generated different tokens")

    def lines(self, shapes) -> list[str]:
        out = []
        for count, new_tokens in shapes:
            direct, fleet = self.rates[(count, new_tokens), "direct"], self.rates[(count, new_tokens), "fleet"]
            med_d, med_f = statistics.median(direct), statistics.median(fleet)
            out.append(f"{count} prompts x {new_tokens} tokens: medians bare vLLM {med_d:,.0f} tokens/s, "
                       f"fleet {med_f:,.0f} tokens/s, fleet/direct = {med_f / med_d:.3f}; best runs "
                       f"{max(direct):,.0f} vs {max(fleet):,.0f} = {max(fleet) / max(direct):.3f} "
                       f"(target >= 0.9)")
            out.append(self.cpu_line(count, new_tokens))
        return out

    def cpu_line(self, count: int, new_tokens: int) -> str:
        """Median CPU ms per 1,000 generated tokens, by process, each way, side by side."""
        cells = []
        for way in WAYS:
            rounds = self.cpu[(count, new_tokens), way]
            medians = {part: statistics.median(r[part] for r in rounds) for part in PARTS}
            total = statistics.median(sum(r.values()) for r in rounds)
            cells.append(f"{way}: " + ", ".join(f"{part} {medians[part]:.0f}" for part in PARTS)
                         + f", all {total:.0f}")
        return f"  CPU ms per 1k tokens (medians) {'; '.join(cells)}"


async def warm(runner, way: str, shapes) -> None:
    for count, new_tokens in shapes:
        await runner.run(count, new_tokens, f"warm-{way}-{count}")


async def bench(run_dir: Path, shapes, rounds: int, layout: str) -> list[str]:
    from rollout_fleet.adapters.tiny_model import build_tiny_model
    from rollout_fleet.adapters.vllm.host import VllmEngineConfig

    config = VllmEngineConfig(model=str(build_tiny_model(run_dir / "model", seed=0)))
    tally = Tally(shapes)
    async with contextlib.AsyncExitStack() as stack:
        async def open_way(way: str):
            runner = BareVllm(config.engine_kwargs()) if way == "direct" else \
                await Fleet(run_dir, config).start()
            stack.push_async_callback(runner.close)
            await warm(runner, way, shapes)
            return runner

        if layout == "interleaved":
            runners = {way: await open_way(way) for way in WAYS}
            for shape in shapes:
                for round_index in range(rounds):
                    for way in (WAYS if round_index % 2 == 0 else WAYS[::-1]):
                        await asyncio.sleep(QUIET_BETWEEN_WAYS_S)
                        await tally.round(runners[way], way, shape, round_index)
        else:
            for way in WAYS:
                runner = await open_way(way)
                for shape in shapes:
                    for round_index in range(rounds):
                        await tally.round(runner, way, shape, round_index)
                await stack.aclose()  # this way's engine goes before the next one starts
    return tally.lines(shapes)


def parse_shape(text: str) -> tuple[int, int]:
    count, _, tokens = text.partition("x")
    return int(count), int(tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=["64x32", "256x64"])
    parser.add_argument("--layout", choices=["sequential", "interleaved"], default="sequential")
    parser.add_argument("--client", nargs=4, metavar=("URL", "COUNT", "TOKENS", "TAG"),
                        help=argparse.SUPPRESS)  # internal: the fleet way's client process
    args = parser.parse_args(argv)
    if args.client:
        url, count, tokens, tag = args.client
        asyncio.run(client_main(url, int(count), int(tokens), tag))
        return 0
    # Installed before Dynamo's, which runs first and then calls this one (see endpoint.py).
    signal.signal(signal.SIGTERM, lambda *_: None)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-frontend-") as run_dir:
        lines = asyncio.run(bench(Path(run_dir), [parse_shape(s) for s in args.shapes],
                                  args.rounds, args.layout))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
