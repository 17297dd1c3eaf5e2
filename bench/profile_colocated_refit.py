"""Where an in-place colocated refit's time goes, call by call, on one device.

    python3 bench/profile_colocated_refit.py --device cuda --size 1     # or 8; --device cpu, --size 0

Two processes as in bench_colocated_refit.py (the trainer with its tensors held in place by a
``ColocatedSender``, the engine's ``ColocatedTransferEngine`` over a plain model behind the
worker's controls, the calls across a pipe). After three warm-up refits, ten refits are timed:
each control call as the trainer sees it (the pipe included) and as the engine's service runs
it, beside the copy floor (one ``copy_`` of every tensor, as the bench's copy column); then
five more refits under cProfile in the engine process, its busiest functions printed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import bench_colocated_refit as bench  # noqa: E402  (it makes the package importable)
from rollout_fleet.adapters.collective.colocated_sender import ColocatedSender  # noqa: E402
from rollout_fleet.core.colocated_service import WorkerColocatedRefit  # noqa: E402


def _ms(values) -> float:
    return round(sorted(values)[len(values) // 2] * 1e3, 2)


def engine(args, connection):
    model = bench.built_model(args, seed=2)
    target = bench.StandaloneColocated(model, bench.device_of(args))
    controls = WorkerColocatedRefit(target).controls()
    loop, seconds, profile = asyncio.new_event_loop(), collections.defaultdict(list), None
    while True:
        message = connection.recv()
        if message[0] == "control":
            started = time.perf_counter()
            answer = loop.run_until_complete(controls[message[1]](message[2]))
            seconds[message[1]].append(time.perf_counter() - started)
            connection.send(("ok", answer))
        elif message[0] == "reset":
            seconds.clear()
            connection.send(("ok", None))
        elif message[0] == "profile":
            profile = cProfile.Profile()
            profile.enable()
            connection.send(("ok", None))
        elif message[0] == "report":
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
            connection.send(("ok", ({k: _ms(v) for k, v in seconds.items()},
                                    dict(target.colocated_stats()), text.getvalue())))
            return


class TimedControl(bench.PipeControl):
    def __init__(self, connection):
        super().__init__(connection)
        self.seconds = collections.defaultdict(list)

    async def call(self, name, body, *, timeout_s=None):
        started = time.perf_counter()
        answer = await super().call(name, body, timeout_s=timeout_s)
        self.seconds[name].append(time.perf_counter() - started)
        return answer


def trainer(args, connection):
    model, copy = bench.built_model(args, seed=1), bench.built_model(args, seed=3)
    device = bench.device_of(args)
    control = TimedControl(connection)
    sender = ColocatedSender(control, buffer_bytes=args.buffer_mib << 20, device=str(device))
    sender.make_resident(model.weights)
    for _ in range(3):
        sender.send(model.state_dict())
    connection.send(("reset",))
    connection.recv()
    control.seconds.clear()
    refits = [sender.send(model.state_dict()).seconds for _ in range(10)]
    floor = []
    for _ in range(10):
        bench.synchronize(device)
        started = time.perf_counter()
        for name, tensor in model.weights.items():
            copy.weights[name].copy_(tensor)
        bench.synchronize(device)
        floor.append(time.perf_counter() - started)
    print(f"{bench.MODELS[args.size][0]}: {len(model.weights)} tensors; refit {_ms(refits)} ms,"
          f" copy {_ms(floor)} ms ({_ms(refits) / _ms(floor):.2f}x)", flush=True)
    print(f"  calls as the trainer sees them (ms): "
          f"{ {k: _ms(v) for k, v in control.seconds.items()} }", flush=True)
    connection.send(("profile",))
    connection.recv()
    for _ in range(5):
        sender.send(model.state_dict())
    sender.close()  # its release call goes to the engine before the engine's last answer
    connection.send(("report",))
    _ok, (calls, stats, profile) = connection.recv()
    print(f"  calls as the engine's service runs them (ms): {calls}\n  the engine's last refit:"
          f" {stats}\n{profile}", flush=True)


def _run(role, args, connections):
    (trainer if role == 0 else engine)(args, connections[role])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", type=int, default=0, help="model: 0, 1, 8 (bench_gpu_refit's)")
    parser.add_argument("--buffer-mib", type=int, default=1024)
    args = parser.parse_args(argv)
    connections = mp.get_context("spawn").Pipe()
    mp.start_processes(_run, args=(args, connections), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
