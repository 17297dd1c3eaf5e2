"""Which of the project's files a rollout and a refit run code in, measured by a profiler hook.

A fleet of one worker as a user starts it (``Fleet.start``, local placement, the real Dynamo
frontend), driven by the driver the fleet hands out (``Fleet.generation``: the http adapter's
clients with the fleet's attempt timeout, under the nemo_rl adapter), the trainer's end of the
refit group in this process too. The worker is the fleet's own command
(``python -m rollout_fleet.wiring.worker``) started through this module, which sets a profile
hook on every thread of the worker host process first; this process hooks its own. A vLLM
engine's engine-core process is vLLM's and is not hooked.

After a warm-up of each path (imports and first calls are not the path), both processes record
every project file a function of which is entered while one more rollout, then one more refit,
runs (the join of the refit group, once per run, is not part of a refit; nor is what the
background loops named in ``BACKGROUND`` call meanwhile). Prints JSON, one object per path:
``{"rollout": {"files": [...], "driver": [...], "worker": [...], "functions": [...]}, "refit":
{...}}``, paths relative to the checkout; only the product's layers (core, ports, adapters,
wiring) are counted.

    .venv/bin/python -m tests.support.path_trace vllm|memory
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

import rollout_fleet.core
from rollout_fleet.adapters.local import LocalPlacement
from rollout_fleet.ports.placement import WorkerHandle, WorkerLaunch

PACKAGE = Path(rollout_fleet.core.__file__).resolve().parents[1]
CHECKOUT = Path(__file__).resolve().parents[2]
LAYERS = ("core/", "ports/", "adapters/", "wiring/")  # the product's own code
# Loops that tick whatever the traffic (the worker's engine watchdog, the driver's metrics
# sampler): what they call is not part of a rollout or a refit.
BACKGROUND = frozenset({"_leave_when_engine_dies", "_sample_forever"})
ENGINES = {"vllm": {"kind": "vllm"},
           "memory": {"kind": "memory", "seed": 0, "context_length": 128}}
SETTLE_S = 1.0  # how long a window stays open after its call returned
WORKER_MODULE = "rollout_fleet.wiring.worker"
COMMANDS = "commands"  # the worker's trace takes "start" and "stop NAME" lines from this fifo
RECORDING = "recording"  # written by the worker once its window is open


class FileTrace:
    """A profile hook for every thread: the project files entered while recording."""

    def __init__(self) -> None:
        self.root = str(PACKAGE) + "/"
        self.functions: set[str] = set()
        self.recording = False

    def __call__(self, frame, event, _arg):
        if self.recording and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(self.root) and name[len(self.root):].startswith(LAYERS) \
                    and not _in_background(frame):
                self.functions.add(f"{name[len(self.root):]}:{frame.f_code.co_name}")

    def start(self) -> None:
        self.functions = set()
        self.recording = True

    def stop(self) -> list[str]:
        self.recording = False
        return sorted(self.functions)

    def hook(self) -> None:
        """On this thread and every thread started from now on."""
        sys.setprofile(self)
        threading.setprofile(self)


def _in_background(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name in BACKGROUND:
            return True
        frame = frame.f_back
    return False


def _unhook() -> None:
    sys.setprofile(None)
    threading.setprofile(None)


def files_of(functions: Sequence[str]) -> list[str]:
    return sorted({function.split(":", 1)[0] for function in functions})


# -- the worker host process ------------------------------------------------------------------

def serve_traced_worker(trace_dir: Path, worker_argv: list[str]) -> int:
    """The fleet's worker, hooked; recording windows opened and closed through the fifo."""
    trace = FileTrace()
    os.register_at_fork(after_in_child=_unhook)  # a forked engine process is not the host
    # Started before the hook, so its own work is not traced.
    threading.Thread(target=_take_commands, args=(trace, trace_dir), name="path-trace-commands",
                     daemon=True).start()
    trace.hook()
    from rollout_fleet.wiring.worker import main as worker_main

    return worker_main(worker_argv)


def _take_commands(trace: FileTrace, trace_dir: Path) -> None:
    with open(trace_dir / COMMANDS) as commands:
        for line in commands:
            words = line.split()
            if words == ["start"]:
                trace.start()
                (trace_dir / RECORDING).touch()  # the driver sends nothing before it sees this
            elif words[:1] == ["stop"]:
                partial = trace_dir / f"{words[1]}.json.partial"
                partial.write_text(json.dumps(trace.stop()))
                partial.rename(trace_dir / f"{words[1]}.json")


class TracedPlacement(LocalPlacement):
    """The local placement, but each worker's command runs through this module's hook."""

    def __init__(self, trace_dir: Path, **options) -> None:
        super().__init__(**options)
        self.trace_dir = trace_dir

    def launch(self, launches: Sequence[WorkerLaunch]) -> Sequence[WorkerHandle]:
        return super().launch([self._traced(launch) for launch in launches])

    def _traced(self, launch: WorkerLaunch) -> WorkerLaunch:
        python, flag, module, *args = launch.argv
        assert (flag, module) == ("-m", WORKER_MODULE), launch.argv
        pythonpath = os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))
        return attrs.evolve(launch, argv=(python, "-m", __spec__.name, "worker",
                                          str(self.trace_dir), *args),
                            env={**launch.env, "PYTHONPATH": pythonpath})


class WorkerTrace:
    """This process's end of the worker's fifo."""

    def __init__(self, trace_dir: Path) -> None:
        self.trace_dir = trace_dir
        self._commands = open(trace_dir / COMMANDS, "w")  # blocks until the worker reads it

    def start(self, timeout_s: float = 30) -> None:
        """Open the worker's window and wait until it is open: on a busy machine its command
        thread may read the line after a fast rollout has come and gone."""
        recording = self.trace_dir / RECORDING
        recording.unlink(missing_ok=True)
        self._commands.write("start\n")
        self._commands.flush()
        deadline = time.monotonic() + timeout_s
        while not recording.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the worker's trace did not open its window")
            time.sleep(0.01)

    def stop(self, name: str, timeout_s: float = 30) -> list[str]:
        self._commands.write(f"stop {name}\n")
        self._commands.flush()
        done = self.trace_dir / f"{name}.json"
        deadline = time.monotonic() + timeout_s
        while not done.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker's trace wrote no {done.name}")
            time.sleep(0.05)
        return json.loads(done.read_text())


# -- the driver's process ---------------------------------------------------------------------

def record(driver: FileTrace, worker: WorkerTrace, name: str, run: Callable[[], None]) -> dict:
    worker.start()
    driver.start()
    try:
        run()
        # The worker finishes a request after its answer left (the generator's last
        # resumption, its counts): that tail belongs to this path, not the next one.
        time.sleep(SETTLE_S)
    finally:
        driver_functions = driver.stop()
        worker_functions = worker.stop(name)
    return {"files": files_of(driver_functions + worker_functions),
            "driver": files_of(driver_functions), "worker": files_of(worker_functions),
            "functions": sorted(set(driver_functions) | set(worker_functions))}


def new_weights(engine: str, seed: int) -> dict:
    """Weights for the worker's model (float32, names and shapes as it holds them)."""
    import torch

    if engine == "vllm":
        from rollout_fleet.adapters.tiny_model import tiny_state_dict

        return tiny_state_dict(seed)
    from rollout_fleet.adapters.memory.model import TinyBigramModel

    return {name: torch.tensor(matrix, dtype=torch.float32) for name, matrix in
            TinyBigramModel.from_seed(seed).state_dict().items()}


def measure(engine: str) -> dict:
    import asyncio

    import torch

    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.shared import free_port
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    run_dir = Path(tempfile.mkdtemp(prefix="path-trace-"))
    trace_dir = run_dir / "trace"
    trace_dir.mkdir()
    os.mkfifo(trace_dir / COMMANDS)
    # Dynamo's canary health check would send the worker requests of its own, whatever else
    # runs: off, so that none lands in a window.
    config = parse_config({
        "placement": "local", "num_workers": 1, "engine": ENGINES[engine], "max_model_len": 128,
        "max_new_tokens": 8, "run_dir": str(run_dir / "fleet"),
        "timeouts": {"start_s": 400, "refit_s": 60},
        "env": {"DYN_HEALTH_CHECK_ENABLED": "false", "DYN_LOG": "error"}})
    fleet = Fleet.start(config, TracedPlacement(trace_dir, bind_host=config.bind_host,
                                                stop_grace_s=config.timeouts.shutdown_s))
    # Named, so that whoever runs this can stop them should this process be killed.
    print(f"process groups {' '.join(map(str, fleet.process_groups()))}", file=sys.stderr, flush=True)
    try:
        worker = WorkerTrace(trace_dir)
        driver = FileTrace()
        driver.hook()  # from here: the driver's threads start after this
        generation = fleet.generation()
        batch = {"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])}
        loop = asyncio.new_event_loop()  # one loop, as a trainer's: its pooled client is kept

        def rollout() -> None:
            async def one() -> None:
                async for _ in generation.generate_async(batch, greedy=True):
                    pass
            loop.run_until_complete(one())

        port = free_port("127.0.0.1")
        world_size = 1 + generation.get_inference_world_size()
        joining = generation.init_collective("127.0.0.1", port, world_size, train_world_size=1)
        with TrainerRefitSession("127.0.0.1", port, 0, world_size, timeout_s=60,
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
            refit(new_weights(engine, 1))
            weights = new_weights(engine, 2)
            paths = {"rollout": record(driver, worker, "rollout", rollout),
                     "refit": record(driver, worker, "refit", lambda: refit(weights))}
        _unhook()
        generation.shutdown()
        loop.close()
    finally:
        fleet.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    return paths


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        return serve_traced_worker(Path(argv[1]), argv[2:])
    (engine,) = argv
    print(json.dumps(measure(engine)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
