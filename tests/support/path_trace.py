"""Which of the project's files a rollout and a refit run code in, measured by a profiler hook.

One process holds a whole fleet of one: a real Dynamo frontend (a child process), the worker
composed by ``wiring/worker.py``'s ``serve_worker`` on a thread of this process (memory engine),
and the driver built by ``wiring/driver.py``'s ``build_generation``, so one profiler hook sees
both ends. After a warm-up of each path (imports and first calls are not the path), it records
every project file a function of which is entered while one more rollout, then one more refit,
runs (the join of the refit group, once per run, is not part of a refit; nor is what the
background loops named in ``BACKGROUND`` call meanwhile). Prints JSON:
``{"rollout": {"files": [...], "functions": [...]}, "refit": {...}}``, paths relative to the
checkout; only the product's layers (core, ports, adapters, wiring) are counted.

    .venv/bin/python -m tests.support.path_trace

The memory engine runs in the worker's own process, so nothing is left behind when this one
leaves; a vLLM engine's processes would be (the worker thread is not stopped, only left).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import rollout_fleet.core

PACKAGE = Path(rollout_fleet.core.__file__).resolve().parents[1]
LAYERS = ("core/", "ports/", "adapters/", "wiring/")  # the product's own code
# Loops that tick whatever the traffic (the worker's engine watchdog, the driver's metrics
# sampler): what they call is not part of a rollout or a refit.
BACKGROUND = frozenset({"_leave_when_engine_dies", "_sample_forever"})
SERVED = "traced"
ENGINE = {"kind": "memory", "seed": 0, "context_length": 128}
SETTLE_S = 1.0  # how long a window stays open after its call returned
SECRET = "path-trace-secret"


class FileTrace:
    """A profile hook for every thread: the project files entered while recording."""

    def __init__(self) -> None:
        self.root = str(PACKAGE) + "/"
        self.files: set[str] = set()
        self.functions: set[str] = set()
        self.recording = False

    def __call__(self, frame, event, _arg):
        if self.recording and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(self.root) and name[len(self.root):].startswith(LAYERS) \
                    and not _in_background(frame):
                self.files.add(name[len(self.root):])
                self.functions.add(f"{name[len(self.root):]}:{frame.f_code.co_name}")

    def record(self, run) -> dict[str, list[str]]:
        self.files, self.functions = set(), set()
        self.recording = True
        try:
            run()
            # The worker finishes a request after its answer left (the generator's last
            # resumption, its counts): that tail belongs to this path, not the next one.
            time.sleep(SETTLE_S)
        finally:
            self.recording = False
        return {"files": sorted(self.files), "functions": sorted(self.functions)}


def _in_background(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name in BACKGROUND:
            return True
        frame = frame.f_back
    return False


def start_worker(run_dir: Path, system_port: int, trace: FileTrace):
    """``serve_worker`` on a thread of its own (Dynamo's worker serves until this process ends)."""
    from rollout_fleet.wiring.worker import serve_worker

    config = {"engine": ENGINE,
              "run_dir": str(run_dir), "namespace": "trace", "served_model_name": SERVED,
              "system_port": system_port, "control_secret": SECRET, "worker_id": "worker-0"}

    # Dynamo's canary health check would send the worker requests of its own, whatever else
    # runs: off, so that none lands in a window.
    os.environ["DYN_HEALTH_CHECK_ENABLED"] = "false"

    def serve() -> None:
        sys.setprofile(trace)
        asyncio.run(serve_worker(config))

    threading.Thread(target=serve, name="traced-worker", daemon=True).start()


def weights_of(seed: int) -> dict:
    """New weights for the worker's model (float32, names and shapes as it holds them)."""
    import torch

    from rollout_fleet.adapters.memory.model import TinyBigramModel

    return {name: torch.tensor(matrix, dtype=torch.float32) for name, matrix in
            TinyBigramModel.from_seed(seed).state_dict().items()}


def main() -> int:
    import torch

    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.dynamo import DynamoFrontend
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation
    from tests.support.net import free_port

    trace = FileTrace()
    sys.setprofile(trace)
    threading.setprofile(trace)
    run_dir = Path(tempfile.mkdtemp(prefix="path-trace-"))
    system_port = free_port()
    start_worker(run_dir, system_port, trace)
    frontend = DynamoFrontend(run_dir, http_port=free_port()).start()
    # Its own process group: named, so whoever runs this can stop it should this be killed.
    print(f"frontend process group {frontend.process.pid}", file=sys.stderr, flush=True)
    try:
        frontend.wait_for_model(SERVED, timeout_s=180)
        generation = build_generation(
            GenerationConfig(model=SERVED, max_model_len=128, max_new_tokens=8),
            frontend_url=frontend.url, control_secret=SECRET,
            workers=[WorkerEndpoint("worker-0", f"http://127.0.0.1:{system_port}")])
        batch = {"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])}

        loop = asyncio.new_event_loop()  # one loop, as a trainer's: its pooled client is kept

        def rollout() -> None:
            async def one() -> None:
                async for _ in generation.generate_async(batch, greedy=True):
                    pass
            loop.run_until_complete(one())

        port = free_port()
        joining = generation.init_collective("127.0.0.1", port, 2, train_world_size=1)
        with TrainerRefitSession("127.0.0.1", port, 0, 2, timeout_s=60,
                                 spec=generation.get_collective_sender_spec()) as trainer:
            for future in joining:
                future.result(timeout=60)

            def refit(weights: dict) -> None:
                info = generation.prepare_refit_info(
                    {n: (tuple(t.shape), "float32") for n, t in weights.items()})
                updates = generation.update_weights_from_collective()
                trainer.send_state_dict(weights, info)
                for future in updates:
                    future.result(timeout=60)

            rollout()  # warm-ups
            refit(weights_of(1))
            new_weights = weights_of(2)
            paths = {"rollout": trace.record(rollout),
                     "refit": trace.record(lambda: refit(new_weights))}
        generation.shutdown()
    finally:
        frontend.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(paths), flush=True)
    # Dynamo's worker serves on its thread until a signal; this process leaves without it.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
