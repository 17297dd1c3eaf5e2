"""Memory of a vLLM engine during and after refits, against the receive bound.

    .venv/bin/python bench/bench_refit_memory.py [--reps 3] [--hidden 1024] [--layers 7]

One vLLM worker (Ray, Dynamo, loopback, inside `unshare -n`: the script re-executes itself
there) serves a Llama-style float32 model built locally (~366 MiB at the defaults), with
2 x 32 MiB refit buffers and ``refit_rollback = "none"``. This process is the trainer; it
refits the worker ``--reps`` times, alternating two seeds, and samples the RSS of vLLM's
processes under the worker (every 20 ms during each refit, once after it). Growth is against
their RSS before the first refit (after one warm-up generation). The bound: the receiver's
``num_buffers`` blocks of the plan's largest bucket, plus what vLLM's layerwise reload holds
for one layer (its parameters materialized afresh: the largest fused layer's bytes).
After the last refit the worker's greedy answers must equal transformers on the model sent.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOST = "127.0.0.1"
MiB = 2**20


def vllm_processes(worker_pid: int) -> list:
    import psutil

    return [p for p in psutil.Process(worker_pid).children(recursive=True)
            if "resource_tracker" not in " ".join(_cmdline(p))]


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


def rss(processes) -> dict[int, int]:
    import psutil

    sizes = {}
    for process in processes:
        try:
            sizes[process.pid] = process.memory_info().rss
        except psutil.Error:
            pass
    return sizes


class PeakSampler:
    """The largest RSS of each process while the block runs."""

    def __init__(self, processes, every_s: float = 0.02) -> None:
        self.processes, self.every_s = processes, every_s
        self.peak: dict[int, int] = {}
        self._done = threading.Event()

    def __enter__(self) -> "PeakSampler":
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        for pid, size in rss(self.processes).items():
            self.peak[pid] = max(self.peak.get(pid, 0), size)

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._sample()


def bound_of(info, buffer_bytes: int, num_buffers: int, state) -> tuple[int, int]:
    """(receive blocks' bytes, the largest fused layer's bytes) for this model and geometry."""
    from rollout_fleet.core.refit import max_bucket_bytes, plan_buckets

    blocks = num_buffers * max_bucket_bytes(plan_buckets(info.tensors, buffer_bytes))
    fused: dict[str, int] = {}
    for name, tensor in state.items():
        key = name
        for part, whole in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"),
                            ("gate_proj", "gate_up"), ("up_proj", "gate_up")):
            key = key.replace(part, whole)
        fused[key] = fused.get(key, 0) + tensor.numel() * tensor.element_size()
    return blocks, max(fused.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--buffer-mib", type=int, default=32)
    parser.add_argument("--num-buffers", type=int, default=2)
    args = parser.parse_args()

    from private_netns import reexec_in_private_netns

    reexec_in_private_netns()
    import ray
    from safetensors.torch import load_file

    from bench.bench_refit_fleet import check_serves
    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.shared import free_port
    from rollout_fleet.adapters.tiny_model import build_tiny_model
    from rollout_fleet.adapters.tiny_model.build import TinyModelSpec
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    work = Path(tempfile.mkdtemp(prefix="bench-refit-memory-"))
    spec = TinyModelSpec(hidden_size=args.hidden, num_heads=args.hidden // 64,
                         num_kv_heads=args.hidden // 64, num_layers=args.layers,
                         intermediate_size=args.hidden * 3)
    models = [build_tiny_model(work / name, seed=seed, spec=spec) for seed, name in ((0, "a"), (1, "b"))]
    states = [load_file(str(m / "model.safetensors")) for m in models]
    nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
    buffer_bytes = args.buffer_mib * MiB
    config = parse_config({
        "engine": {"kind": "vllm", "refit_rollback": "none"}, "model": str(models[0]),
        "num_workers": 1, "max_model_len": 512, "run_dir": str(work / "fleet"),
        "refit": {"buffer_bytes": buffer_bytes, "num_buffers": args.num_buffers},
        "timeouts": {"start_s": 900, "refit_s": 600}})
    fleet = Fleet.start(config)
    generation = fleet.generation()
    session = None
    try:
        (worker,) = fleet.workers
        processes = vllm_processes(worker.pid)
        port = free_port(HOST)
        joining = generation.init_collective(HOST, port, 2, train_world_size=1)
        session = TrainerRefitSession(HOST, port, 0, 2, spec=generation.get_collective_sender_spec(),
                                      timeout_s=600)
        ray.get(joining, timeout=600)
        info = generation.prepare_refit_info(
            {n: (tuple(t.shape), t.dtype) for n, t in states[0].items()})
        check_serves(generation, models[0])  # warm: the first generation allocates its own
        blocks, layer = bound_of(info, buffer_bytes, args.num_buffers, states[0])
        print(f"model: hidden {args.hidden}, {args.layers} layers, {len(states[0])} tensors,"
              f" {nbytes / MiB:.0f} MiB float32; buffers {args.num_buffers} x {args.buffer_mib} MiB;"
              f" receive bound {blocks / MiB:.0f} MiB (blocks of the largest bucket)"
              f" + {layer / MiB:.0f} MiB (the largest fused layer, materialized by the reload)",
              flush=True)
        base = rss(processes)
        names = {p.pid: " ".join(_cmdline(p))[:40] or p.name() for p in processes}
        print("before: " + ", ".join(f"pid {pid} ({names[pid]}) {size / MiB:.0f} MiB"
                                     for pid, size in base.items()), flush=True)
        growths = []
        for rep in range(args.reps):
            with PeakSampler(processes) as sampler:
                started = time.perf_counter()
                updating = generation.update_weights_from_collective()
                session.send_state_dict(states[(rep + 1) % 2], info)
                ray.get(updating, timeout=600)
                generation.invalidate_kv_cache()
                seconds = time.perf_counter() - started
            time.sleep(1.0)
            after = rss(processes)
            peak = {pid: sampler.peak[pid] - base[pid] for pid in base}
            settled = {pid: after[pid] - base[pid] for pid in base}
            growths.append((max(peak.values()), max(settled.values())))
            print(f"refit {rep + 1} ({seconds:.2f} s): growth at the peak "
                  + ", ".join(f"{peak[p] / MiB:+.0f}" for p in base) + " MiB, after "
                  + ", ".join(f"{settled[p] / MiB:+.0f}" for p in base) + " MiB (per process)",
                  flush=True)
        check_serves(generation, models[args.reps % 2])
    finally:
        if session is not None:
            session.close()
        generation.shutdown()
        fleet.shutdown()
    peak, after = max(g[0] for g in growths), max(g[1] for g in growths)
    print(f"largest growth of one vLLM process: {peak / MiB:.0f} MiB at the peak, {after / MiB:.0f}"
          f" MiB after a refit; bound {(blocks + layer) / MiB:.0f} MiB"
          f" ({blocks / MiB:.0f} receive + {layer / MiB:.0f} loader); model {nbytes / MiB:.0f} MiB")


if __name__ == "__main__":
    main()
