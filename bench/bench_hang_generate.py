"""A worker whose engine core hangs under `rollout-fleet generate`: how long the batch takes.

Starts a fleet of 2 vLLM workers (local placement, the embedded tiny model, greedy), runs
``rollout-fleet generate`` of N prompts x T tokens against its frontend, and SIGSTOPs worker-0's
engine core some seconds in. Prints the wall time of ``generate``, the results it wrote and
what the fleet reports lost. Every process it starts is stopped (by process group) at the end.

    unshare -n sh -c 'ip link set lo up && .venv/bin/python bench/bench_hang_generate.py \
        --prompts 256 --tokens 200 --stop-at-s 6'
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def engine_core_of(worker_pid: int):
    import psutil

    children = psutil.Process(worker_pid).children()
    titled = [c for c in children if "EngineCor" in " ".join(c.cmdline()) + c.name()]
    if titled:
        return titled[0]
    return next(c for c in children if c.children())


def write_prompts(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as out:
        for index in range(count):
            prompt = [rng.randrange(3, 512) for _ in range(rng.randint(4, 16))]
            out.write(json.dumps({"id": f"p{index}", "prompt_token_ids": prompt}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--stop-at-s", type=float, default=6.0, help="SIGSTOP worker-0's core then")
    parser.add_argument("--hang-timeout-s", type=float, default=None, help="default: the fleet's")
    args = parser.parse_args()
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    run_dir = Path(tempfile.mkdtemp(prefix="bench-hang-"))
    timeouts = {"start_s": 600}
    if args.hang_timeout_s is not None:
        timeouts["hang_timeout_s"] = args.hang_timeout_s
    config = parse_config({"engine": {"kind": "vllm"}, "placement": "local", "num_workers": 2,
                           "max_new_tokens": args.tokens, "max_model_len": 512,
                           "run_dir": str(run_dir / "fleet"), "timeouts": timeouts})
    prompts, out = run_dir / "prompts.jsonl", run_dir / "out.jsonl"
    write_prompts(prompts, args.prompts)
    fleet = Fleet.start(config)
    generate = None
    try:
        core = engine_core_of(next(w.pid for w in fleet.workers if w.name == "worker-0"))
        command = [sys.executable, "-m", "rollout_fleet.wiring.cli", "generate",
                   "--url", fleet.frontend_url, "--prompts", str(prompts), "--out", str(out),
                   "--greedy", "--max-new-tokens", str(args.tokens), "--max-model-len", "512",
                   "--concurrency", str(args.prompts), "--quiet"]
        started = time.monotonic()
        generate = subprocess.Popen(command, process_group=0)
        time.sleep(args.stop_at_s)
        os.kill(core.pid, signal.SIGSTOP)
        stopped_at = time.monotonic() - started
        code = generate.wait()
        took = time.monotonic() - started
        results = sum(1 for line in out.read_text().splitlines() if line.strip())
        errors = sum(1 for line in out.read_text().splitlines() if '"error"' in line)
        print(f"generate: exit {code}, {results} of {args.prompts} results ({errors} errors) in "
              f"{took:.1f} s; worker-0's engine core stopped at {stopped_at:.1f} s; hang_timeout_s="
              f"{config.hang_timeout_s:g}; lost: {fleet.lost_workers()}")
        return 0 if code == 0 and results == args.prompts and errors == 0 else 1
    finally:
        if generate is not None and generate.poll() is None:
            os.killpg(generate.pid, signal.SIGKILL)
            generate.wait()
        fleet.shutdown()


if __name__ == "__main__":
    sys.exit(main())
