"""Bytes per second of a packed refit vs one flat broadcast of the same bytes (the floor).

    .venv/bin/python bench/bench_refit_collective.py [--layers 6] [--reps 3]

One sender (this process, rank 0) and two receivers (spawned processes, ranks 1 and 2) form one
gloo group on 127.0.0.1. The state dict is bf16 with TinyLlama-like layer shapes (hidden 2048,
MLP 5632, 4 KV heads; ~88 MB a layer). Each trial starts and ends on a tiny all-reduce, so the
time covers the slowest receiver. Trials are interleaved (flat, then each geometry, per rep);
the median of --reps is printed with the ratio to the flat broadcast (1.00 = the floor).

packed: TorchWeightSender.send -> TorchWeightReceiver.receive (header check, packing, buffers in
        flight, the receiver handing out views of fresh blocks; the tensors are dropped; on the
        last rep each receiver checks every tensor against the sender's, bit for bit).
flat:   one broadcast of a preallocated uint8 buffer of the same total size, whole, and in 4 MiB
        chunks all in flight (gloo sends one large broadcast to one receiver at a time); the
        floor is the faster of the two medians.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_fleet.adapters.collective import (  # noqa: E402
    TorchWeightReceiver, TorchWeightSender, init_group,
)
from rollout_fleet.adapters.collective.transfer import refit_info_of  # noqa: E402
from rollout_fleet.adapters.collective.wire import GLOO_WIRE_CHUNK_BYTES  # noqa: E402
from llama_shapes import layer_shapes  # noqa: E402  (bench/, the script's own folder)
from rollout_fleet.core.refit import CollectiveSenderSpec  # noqa: E402

HOST = "127.0.0.1"
MIB = 1 << 20


def state_dict(layers: int) -> dict[str, torch.Tensor]:
    hidden, inter, kv = 2048, 5632, 256
    gen = torch.Generator().manual_seed(0)
    shapes = {}
    for i in range(layers):
        shapes.update(layer_shapes(i, hidden, inter, kv))
    return {n: torch.randn(s, generator=gen, dtype=torch.bfloat16) for n, s in shapes.items()}


def schedule(reps: int, geometries: list[tuple[int, int]], chunked: bool) -> list[tuple]:
    trials = []
    for _ in range(reps):
        trials.append(("flat",))
        trials.append(("flat-chunked",))
        trials.extend(("packed", b, n) for b, n in geometries)
        if chunked:
            trials.extend(("chunked", b, n) for b, n in geometries)
    return trials


def barrier(group) -> None:
    group.wait(group.all_reduce_sum(torch.zeros(1)), "a barrier")


def chunked_broadcast(group, flat: torch.Tensor, chunk: int, in_flight: int) -> None:
    """The flat buffer in chunks, ``in_flight`` at a time: buffer-size cost without packing."""
    pending = []
    for start in range(0, flat.numel(), chunk):
        if len(pending) == in_flight:
            group.wait(pending.pop(0), "a chunk")
        pending.append(group.broadcast(flat[start:start + chunk]))
    for work in pending:
        group.wait(work, "a chunk")


_ENDS: dict[tuple, object] = {}  # one sender / receiver per geometry, as a trainer keeps one


def run_trial(group, trial: tuple, flat: torch.Tensor, info, sd, check=None) -> None:
    if trial[0] == "flat":
        group.wait(group.broadcast(flat), "the flat broadcast")
    elif trial[0] == "flat-chunked":
        chunked_broadcast(group, flat, GLOO_WIRE_CHUNK_BYTES, flat.numel())
    elif trial[0] == "chunked":
        chunked_broadcast(group, flat, trial[1], trial[2])
    else:
        spec = CollectiveSenderSpec(buffer_bytes=trial[1], num_buffers=trial[2])
        end_type = TorchWeightSender if sd is not None else TorchWeightReceiver
        end = _ENDS.setdefault(trial, end_type(group, spec))
        if sd is not None:
            end.send(info, sd)
        elif check is not None:
            for name, tensor in end.receive(info):
                if not torch.equal(tensor.view(torch.uint8), check[name].view(torch.uint8)):
                    raise SystemExit(f"packed {trial}: {name} arrived with other bytes")
        else:
            for _name, _tensor in end.receive(info):
                pass  # dropped at once, as an engine that loads each tensor would


def receiver_main(port: int, rank: int, layers: int, trials: list[tuple]) -> None:
    group = init_group(HOST, port, rank, 3, "gloo", 300.0)
    expected = state_dict(layers)  # the sender's, drawn from the same seed
    info = refit_info_of(expected)
    flat = torch.empty(info.total_bytes, dtype=torch.uint8)
    last = {trial: index for index, trial in enumerate(trials)}
    for index, trial in enumerate(trials):
        barrier(group)
        run_trial(group, trial, flat, info, None, expected if last[trial] == index else None)
        barrier(group)
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--buffers-mib", default="1,4,16,64,256")
    parser.add_argument("--in-flight", default="2")
    parser.add_argument("--chunked", action="store_true",
                        help="also time the flat buffer broadcast in chunks (no packing)")
    args = parser.parse_args()
    geometries = [(int(m) * MIB, int(n)) for n in args.in_flight.split(",")
                  for m in args.buffers_mib.split(",")]
    trials = schedule(args.reps, geometries, args.chunked)
    sd = state_dict(args.layers)
    info = refit_info_of(sd)
    flat = torch.empty(info.total_bytes, dtype=torch.uint8)
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    joined: dict = {}
    # Rank 0's init waits for the receivers: join in a thread while they start.
    joiner = threading.Thread(target=lambda: joined.update(
        group=init_group(HOST, port, 0, 3, "gloo", 300.0)))
    joiner.start()
    procs = [ctx.Process(target=receiver_main, args=(port, r, args.layers, trials)) for r in (1, 2)]
    times: dict[tuple, list[float]] = {}
    try:
        for proc in procs:
            proc.start()
        joiner.join(300)
        group = joined["group"]
        for trial in trials:
            barrier(group)
            start = time.perf_counter()
            run_trial(group, trial, flat, info, sd)
            barrier(group)
            times.setdefault(trial, []).append(time.perf_counter() - start)
        group.close()
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    report(info.total_bytes, times, len(sd))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def report(total: int, times: dict[tuple, list[float]], count: int) -> None:
    whole = statistics.median(times[("flat",)])
    chunked = statistics.median(times[("flat-chunked",)])
    floor = min(whole, chunked)
    print(f"gloo on 127.0.0.1, 1 sender -> 2 receivers, {count} tensors,"
          f" {total / 2**20:.0f} MiB bf16, torch {torch.__version__},"
          f" median of {len(times[('flat',)])}; every packed geometry arrived bit-exact")
    print(f"  {'flat broadcast, whole':28s} {total / whole / 1e9:6.2f} GB/s  {whole:6.3f} s  {floor / whole:4.2f}")
    print(f"  {'flat broadcast, 4 MiB chunks':28s} {total / chunked / 1e9:6.2f} GB/s  {chunked:6.3f} s"
          f"  {floor / chunked:4.2f}")
    best = 0.0
    for trial, seconds in times.items():
        if trial[0] in ("flat", "flat-chunked"):
            continue
        median = statistics.median(seconds)
        ratio = floor / median
        if trial[0] == "packed":
            best = max(best, ratio)
        label = f"{trial[0]} {trial[1] // MIB} MiB x {trial[2]}"
        print(f"  {label:28s} {total / median / 1e9:6.2f} GB/s  {median:6.3f} s  {ratio:4.2f}")
    print(f"best packed / floor (the faster flat broadcast): {best:.2f} (target >= 0.90)")


if __name__ == "__main__":
    main()
