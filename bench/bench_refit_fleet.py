"""End-to-end refit into a real fleet vs one flat broadcast of the same bytes (the floor).

    .venv/bin/python bench/bench_refit_fleet.py [--reps 3] [--hidden 1024] [--layers 4]

A fleet of 2 vLLM workers (Ray, Dynamo, loopback, inside `unshare -n`: the script re-executes
itself there) serves a Llama-style model built locally (float32, ~200 MB at the defaults). This
process is the trainer: one end-to-end refit is ``update_weights_from_collective`` + sending the
state dict in packed buffers + every worker receiving it inside vLLM's worker and loading each
bucket as it arrives + the cache flush (joining the group is excluded, as it happens once per
run). The floor: a flat gloo broadcast of the same number of bytes from this process into 2
spawned receivers, the faster of one whole broadcast and 4 MiB chunks all in flight, in the
same run, interleaved with the refits. After the last refit, the fleet's greedy answers to a
few prompts must equal a transformers decode of the model last sent (a fast wrong refit fails).
Target: end-to-end <= 1.5x the floor.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOST = "127.0.0.1"


def receiver(port: int, rank: int, nbytes: int, reps: int) -> None:
    import torch

    from rollout_fleet.adapters.collective import init_group

    group = init_group(HOST, port, rank, 3, "gloo", 600, train_world_size=1)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(reps):
        _flat_once(group, buffer)
    group.close()


def _flat_once(group, buffer) -> float:
    """The faster of a whole and a chunked broadcast of ``buffer`` (both timed from a barrier)."""
    import torch

    from rollout_fleet.adapters.collective.wire import GLOO_WIRE_CHUNK_BYTES

    seconds = []
    for chunk in (buffer.numel(), GLOO_WIRE_CHUNK_BYTES):
        group.wait(group.all_reduce_sum(torch.zeros(1)), "barrier")
        started = time.perf_counter()
        works = [group.broadcast(buffer[i:i + chunk]) for i in range(0, buffer.numel(), chunk)]
        for work in works:
            group.wait(work, "flat broadcast")
        group.wait(group.all_reduce_sum(torch.zeros(1)), "barrier")
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--buffer-mib", type=int, default=16)
    args = parser.parse_args()

    from private_netns import reexec_in_private_netns

    reexec_in_private_netns()
    import ray
    import torch
    from safetensors.torch import load_file

    from rollout_fleet.adapters.collective import TrainerRefitSession, init_group
    from rollout_fleet.adapters.shared import free_port
    from rollout_fleet.adapters.tiny_model import build_tiny_model
    from rollout_fleet.adapters.tiny_model.build import TinyModelSpec
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    work = Path(tempfile.mkdtemp(prefix="bench-refit-fleet-"))
    spec = TinyModelSpec(hidden_size=args.hidden, num_heads=args.hidden // 64,
                         num_kv_heads=args.hidden // 64, num_layers=args.layers,
                         intermediate_size=args.hidden * 11 // 4)
    model_a = build_tiny_model(work / "a", seed=0, spec=spec)
    model_b = build_tiny_model(work / "b", seed=1, spec=spec)
    states = [load_file(str(m / "model.safetensors")) for m in (model_a, model_b)]
    nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
    print(f"model: hidden {args.hidden}, {args.layers} layers, {len(states[0])} tensors, "
          f"{nbytes / 2**20:.0f} MiB float32", flush=True)

    floor_port = free_port(HOST)
    context = multiprocessing.get_context("spawn")
    receivers = [context.Process(target=receiver, args=(floor_port, rank, nbytes, args.reps))
                 for rank in (1, 2)]
    for process in receivers:
        process.start()
    floor_group = init_group(HOST, floor_port, 0, 3, "gloo", 600, train_world_size=1)
    flat = torch.ones(nbytes, dtype=torch.uint8)

    config = parse_config({
        "engine": {"kind": "vllm"}, "model": str(model_a), "num_workers": 2,
        "max_model_len": 512, "run_dir": str(work / "fleet"),
        "refit": {"buffer_bytes": args.buffer_mib << 20, "num_buffers": 2},
        "timeouts": {"start_s": 900, "refit_s": 600}})
    fleet = Fleet.start(config)
    generation = fleet.generation()
    session = None
    try:
        port = free_port(HOST)
        joining = generation.init_collective(HOST, port, 3, train_world_size=1)
        session = TrainerRefitSession(HOST, port, 0, 3, spec=generation.get_collective_sender_spec(),
                                      timeout_s=600)
        ray.get(joining, timeout=600)
        info = generation.prepare_refit_info(
            {n: (tuple(t.shape), t.dtype) for n, t in states[0].items()})
        floor_s, refit_s = [], []
        for rep in range(args.reps):
            floor_s.append(_flat_once(floor_group, flat))
            started = time.perf_counter()
            updating = generation.update_weights_from_collective()
            session.send_state_dict(states[(rep + 1) % 2], info)
            answers = ray.get(updating, timeout=600)
            generation.invalidate_kv_cache()
            refit_s.append(time.perf_counter() - started)
            parts = ", ".join(f"{a['seconds']:.3f} s" for a in answers)
            print(f"rep {rep + 1}: flat {floor_s[-1]:.3f} s, end-to-end refit {refit_s[-1]:.3f} s"
                  f" (receive + load inside each worker: {parts})", flush=True)
        versions = generation.get_weight_versions()
        last_sent = (model_a, model_b)[args.reps % 2]
        check_serves(generation, last_sent)
    finally:
        if session is not None:
            session.close()
        generation.shutdown()
        fleet.shutdown()
        floor_group.close()
        for process in receivers:
            process.join(60)
    floor, refit = statistics.median(floor_s), statistics.median(refit_s)
    print(f"weight versions: {versions}")
    print(f"flat broadcast (floor) {nbytes / floor / 1e9:.2f} GB/s  {floor:.3f} s")
    print(f"end-to-end refit       {nbytes / refit / 1e9:.2f} GB/s  {refit:.3f} s")
    print(f"end-to-end / flat: {refit / floor:.2f}x (target <= 1.5x)")


def check_serves(generation, model_dir, prompts=((5, 17, 42), (100, 7), (9, 9, 250, 3))) -> None:
    """The fleet's greedy answers equal a transformers float32 decode of ``model_dir``."""
    import asyncio

    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    steps = 8
    width = max(map(len, prompts))
    batch = {"input_ids": torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts]),
             "input_lengths": torch.tensor([len(p) for p in prompts])}

    async def served():
        return [pair async for pair in generation.generate_async(batch, greedy=True)]

    for index, sample in asyncio.run(served()):
        start = len(prompts[index])
        got = sample["output_ids"][0, start:start + int(sample["generation_lengths"][0])].tolist()
        with torch.no_grad():
            want = model.generate(torch.tensor([prompts[index]]), max_new_tokens=len(got),
                                  do_sample=False)[0, start:].tolist()
        if got[:steps] != want[:steps]:
            raise SystemExit(f"prompt {index}: the fleet answers {got}, the model sent {want}")
    print(f"after the refits the fleet serves the model last sent: {len(prompts)} greedy answers"
          " equal transformers")


if __name__ == "__main__":
    main()
