"""A refit from a trainer GPU into an engine GPU through the in-engine receiver, bit for bit.

    python3 bench/bench_gpu_refit.py [--sizes 1,8] [--buffer-mib 64,256,1024,2048]
                                     [--in-flight 2,4] [--reps 5]
    python3 bench/bench_gpu_refit.py --device cpu      # the same logic over gloo, a tiny model

Two processes. The trainer (GPU 0) holds a Llama-style bf16 model and sends its state dict with
the project's sender (adapters/collective: packed buckets, ``in-flight`` buffers rotating). The
engine (GPU 1) runs ``PackedTransferEngine``, the class vLLM's worker runs for this project's
protocol, over a plain torch model of the same architecture: each tensor is copied into its
parameter as its bucket arrives (``InPlaceReload``: what vLLM's layerwise reload does for an
unquantised model). After the timed reps of each geometry, the trainer draws new weights, the
engine zeroes its own, one more refit runs, and both sides run a forward pass on the same
prompts: the engine's logits must equal the trainer's bit for bit (same weights, same kernels).

Per geometry, interleaved reps after one warm-up, medians printed (the engine process times
each from a shared barrier until its side is done and synchronised):
  flat:    one broadcast of the state dict's bytes in one buffer (the floor); on gloo the faster
           of that and 4 MiB chunks all in flight (gloo sends a large broadcast to one peer at a time)
  packed:  the sender -> the receiver, buckets dropped on arrival (transfer only)
  refit:   start -> update (receive + load into the model) -> finish -> prefix-cache reset
Ratios: packed/flat = flat time / packed time (1.0 = as fast as the floor); refit/flat = refit
time / flat time. GB/s count the state dict's bytes once; NVLink's limit is 450 GB/s per direction.
Every process it starts gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)  # before torch loads NCCL; spawned children inherit it
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_pack import import_package  # noqa: E402  (the path shim where not installed)

import_package()
from rollout_fleet.adapters.collective import init_group, join_receiver  # noqa: E402
from rollout_fleet.adapters.collective.transfer import refit_info_of  # noqa: E402
from rollout_fleet.adapters.collective.transfer import TorchWeightSender  # noqa: E402
from rollout_fleet.adapters.vllm.inside.transfer_engine import compose_transfer_engine  # noqa: E402
from rollout_fleet.adapters.vllm.messages import PackedInitInfo  # noqa: E402
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin  # noqa: E402

NVLINK_GBPS = 450.0
GLOO_CHUNK = 4 << 20
# name: (hidden, intermediate, heads, kv heads, layers, vocab, tied embedding)
MODELS = {
    0: ("tiny (CPU check)", 128, 256, 4, 2, 2, 512, False),
    1: ("llama-3.2-1b-like: 16 layers, tied 128k embedding", 2048, 8192, 32, 8, 16, 128256, True),
    8: ("llama-3-8b-like: 32 layers, 128k embedding + lm_head", 4096, 14336, 32, 8, 32, 128256, False),
}


class LlamaLike(torch.nn.Module):
    """A Llama decoder in plain torch, parameters named as in Hugging Face checkpoints."""

    def __init__(self, hidden, inter, heads, kv_heads, layers, vocab, tied, device, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.tied = heads, kv_heads, tied
        head_dim = hidden // heads
        shapes = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            })
        shapes["model.norm.weight"] = (hidden,)
        if not tied:
            shapes["lm_head.weight"] = (vocab, hidden)
        self.layers = layers
        self.weights = {name: torch.empty(shape, device=device, dtype=dtype)
                        for name, shape in shapes.items()}
        self.prefix_cache: dict = {}  # what a refit invalidates (a dict, as vLLM's block hashes)

    def state_dict(self, *args, **kwargs):  # noqa: D102 - the refit's source, in wire order
        return dict(self.weights)

    def randomize(self, seed: int) -> None:
        generator = torch.Generator(device=next(iter(self.weights.values())).device).manual_seed(seed)
        for name, weight in self.weights.items():
            if name.endswith("norm.weight"):
                weight.copy_(1.0 + 0.1 * torch.randn(weight.shape, generator=generator,
                                                      device=weight.device, dtype=torch.float32))
            else:
                scale = 1.0 / math.sqrt(weight.shape[-1])
                weight.copy_(scale * torch.randn(weight.shape, generator=generator,
                                                 device=weight.device, dtype=torch.float32))

    def zero(self) -> None:
        for weight in self.weights.values():
            weight.zero_()

    def load_weights(self, named_tensors) -> set[str]:
        """In place, one tensor at a time as it comes (what a vLLM model's load_weights does)."""
        loaded = set()
        for name, tensor in named_tensors:
            self.weights[name].copy_(tensor, non_blocking=True)
            loaded.add(name)
        return loaded

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        w = self.weights
        h = F.embedding(token_ids, w["model.embed_tokens.weight"])
        batch, seq, hidden = h.shape
        head_dim = hidden // self.heads
        cos, sin = _rope(seq, head_dim, h.device, h.dtype)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            x = _rms(h, w[p + "input_layernorm.weight"])
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(batch, seq, self.heads, head_dim)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(batch, seq, self.kv_heads, head_dim)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(batch, seq, self.kv_heads, head_dim)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True)
            h = h + attn.transpose(1, 2).reshape(batch, seq, hidden) @ w[p + "self_attn.o_proj.weight"].T
            x = _rms(h, w[p + "post_attention_layernorm.weight"])
            gate = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
            h = h + gate @ w[p + "mlp.down_proj.weight"].T
        h = _rms(h, w["model.norm.weight"])
        head = w["model.embed_tokens.weight"] if self.tied else w["lm_head.weight"]
        return (h @ head.T).float()


def _rms(x, weight, eps=1e-5):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _rope(seq, head_dim, device, dtype):
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype)[None, :, None, :], angles.sin().to(dtype)[None, :, None, :]


def _apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(args, role: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(role)
    return torch.device("cuda", role)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group, device) -> None:
    _sync(device)
    group.wait(group.all_reduce_sum(torch.zeros(1, device=group.device)), "barrier")
    _sync(device)


def _flat(group, buffer, device) -> float:
    """One broadcast of the whole buffer; on gloo also 4 MiB chunks in flight; the faster."""
    _barrier(group, device)
    start = time.perf_counter()
    group.wait(group.broadcast(buffer), "flat broadcast")
    _sync(device)
    whole = time.perf_counter() - start
    if group.backend != "gloo":
        return whole
    _barrier(group, device)
    start = time.perf_counter()
    works = [group.broadcast(buffer[i:i + GLOO_CHUNK]) for i in range(0, buffer.numel(), GLOO_CHUNK)]
    for work in works:
        group.wait(work, "chunked flat broadcast")
    return min(whole, time.perf_counter() - start)


def geometries(args) -> list[tuple[float, int]]:
    return [(mib, flight) for mib in args.buffer_mib for flight in args.in_flight]


def trainer(args, size, ports, results) -> None:
    device = _device(args, 0)
    name, *shape = MODELS[size]
    model = LlamaLike(*shape, device=device, dtype=torch.bfloat16)
    model.randomize(seed=1)
    state = model.state_dict()
    info = refit_info_of(state)
    flat = torch.empty(info.total_bytes, dtype=torch.uint8, device=device)
    prompts = _prompts(args, shape[5], device)
    backend = "gloo" if args.device == "cpu" else "nccl"
    for index, (mib, flight) in enumerate(geometries(args)):
        spec = CollectiveSenderSpec(buffer_bytes=max(1, int(mib * 2**20)), num_buffers=flight)
        port = _free_port()
        ports.put(port)  # before the rendezvous, which waits for the engine to come
        group = init_group("127.0.0.1", port, 0, 2, backend, 120.0)
        sender = TorchWeightSender(group, spec)
        for _rep in range(args.reps + 1):
            _flat(group, flat, device)
            for _op in ("packed", "refit"):
                _barrier(group, device)
                sender.send(info, state)
                _sync(device)
        model.randomize(seed=100 + index)  # new weights: the check below needs every byte to move
        _barrier(group, device)
        sender.send(info, state)
        logits = model(prompts)
        group.wait(group.broadcast(logits.view(torch.uint8).reshape(-1)), "logits")
        _sync(device)
        sender.close()


def _prompts(args, vocab, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    batch, seq = (2, 8) if args.device == "cpu" else (4, 64)
    return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)


def engine(args, size, ports, results) -> None:
    device = _device(args, 1)
    name, *shape = MODELS[size]
    model = LlamaLike(*shape, device=device, dtype=torch.bfloat16)
    model.randomize(seed=2)
    info = refit_info_of(model.state_dict())
    flat = torch.empty(info.total_bytes, dtype=torch.uint8, device=device)
    prompts = _prompts(args, shape[5], device)
    backend = "gloo" if args.device == "cpu" else "nccl"
    rows = []
    for mib, flight in geometries(args):
        spec = CollectiveSenderSpec(buffer_bytes=max(1, int(mib * 2**20)), num_buffers=flight)
        join = GroupJoin(host="127.0.0.1", port=ports.get(), world_size=2, train_world_size=1,
                         first_rank=1, ranks_per_worker=1, sender_spec=spec, backend=backend,
                         timeout_s=120.0)
        transfer = transfer_engine_over(model, device)
        transfer.init_transfer_engine(PackedInitInfo(join))
        group = transfer.receiver.group
        times = {"flat": [], "packed": [], "refit": []}
        for rep in range(args.reps + 1):
            flat_s = _flat(group, flat, device)
            _barrier(group, device)
            start = time.perf_counter()
            for _name, _view in transfer.receiver.receive(info):
                pass
            _sync(device)
            packed_s = time.perf_counter() - start
            _barrier(group, device)
            start = time.perf_counter()
            _refit(transfer, model, info)
            refit_s = time.perf_counter() - start
            if rep:  # the first is the warm-up
                for key, value in (("flat", flat_s), ("packed", packed_s), ("refit", refit_s)):
                    times[key].append(value)
        model.zero()
        _barrier(group, device)
        _refit(transfer, model, info)
        logits = model(prompts)
        theirs = torch.empty_like(logits)
        group.wait(group.broadcast(theirs.view(torch.uint8).reshape(-1)), "logits")
        exact = bool(torch.equal(logits, theirs)) and bool(torch.equal(logits.argmax(-1), theirs.argmax(-1)))
        transfer.shutdown()
        rows.append(_row(mib, flight, info.total_bytes, times, exact))
        print(_format(rows[-1]), flush=True)
    results.put((name, info.total_bytes, len(info.tensors), rows))


def transfer_engine_over(model, device):
    """``PackedTransferEngine`` composed as wiring/vllm_transfer.py composes it (the collective
    adapter's receiver), but on no vLLM base class: the GPU hosts this runs on have no vLLM.
    Given no vLLM config, it loads each tensor into the model in place."""
    return compose_transfer_engine(object, join_receiver)(None, None, device, model)


def _refit(transfer, model, info) -> None:
    transfer.start_weight_update()
    transfer.update_weights({"refit_info": info.to_wire()})
    transfer.finish_weight_update()
    model.prefix_cache.clear()
    _sync(transfer.device)


def _row(mib, flight, nbytes, times, exact) -> dict:
    med = {key: statistics.median(values) for key, values in times.items()}
    return {"buffer_mib": mib, "in_flight": flight, "exact": exact, "reps": len(times["flat"]),
            "flat_ms": med["flat"] * 1e3, "packed_ms": med["packed"] * 1e3,
            "refit_ms": med["refit"] * 1e3,
            "packed_of_flat": med["flat"] / med["packed"], "refit_over_flat": med["refit"] / med["flat"],
            "flat_gbps": nbytes / med["flat"] / 1e9, "packed_gbps": nbytes / med["packed"] / 1e9,
            "refit_gbps": nbytes / med["refit"] / 1e9}


def _format(row) -> str:
    return (f"  buffer {row['buffer_mib']:>7g} MiB x {row['in_flight']}: flat {row['flat_ms']:8.2f} ms"
            f" ({row['flat_gbps']:6.1f} GB/s)  packed {row['packed_ms']:8.2f} ms"
            f" ({row['packed_gbps']:6.1f} GB/s, {row['packed_of_flat']:.2f} of flat)"
            f"  refit {row['refit_ms']:8.2f} ms ({row['refit_over_flat']:.2f}x flat)"
            f"  bit-exact: {'yes' if row['exact'] else 'NO'}")


def _run(role, args, size, ports, results) -> None:
    (trainer if role == 0 else engine)(args, size, ports, results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", default=None, help="model sizes: 1, 8 (GPU); 0 (CPU)")
    parser.add_argument("--buffer-mib", default=None, help="comma-separated MiB per buffer")
    parser.add_argument("--in-flight", default="2,4", help="comma-separated buffers in flight")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.sizes = [int(s) for s in (args.sizes or ("0" if cpu else "1,8")).split(",")]
    args.buffer_mib = [float(m) for m in (args.buffer_mib or ("0.0625,0.25" if cpu else "64,256,1024,2048")).split(",")]
    args.in_flight = [int(n) for n in args.in_flight.split(",")]
    if not cpu and torch.cuda.device_count() < 2:
        print("needs two GPUs (trainer on GPU 0, engine on GPU 1)", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {args.device}"
          + (f", {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}" if not cpu else "")
          + f"; {', '.join(f'{k}={v}' for k, v in NO_MULTICAST.items())}", flush=True)
    context = mp.get_context("spawn")
    failed = False
    for size in args.sizes:
        ports, results = context.SimpleQueue(), context.SimpleQueue()
        print(f"\n{MODELS[size][0]}", flush=True)
        mp.start_processes(_run, args=(args, size, ports, results), nprocs=2, start_method="spawn")
        name, nbytes, count, rows = results.get()
        print(f"{name}: {count} tensors, {nbytes / 2**30:.2f} GiB bf16; medians of {rows[0]['reps']} reps")
        _summary(rows, cpu)
        failed |= not all(row["exact"] for row in rows)
    print("\nbit-exact in every geometry: " + ("NO" if failed else "yes"))
    return 1 if failed else 0


def _summary(rows, cpu) -> None:
    print("| buffer | in flight | packed / flat | refit / flat | flat GB/s | packed GB/s | refit GB/s"
          + ("" if cpu else " | packed of NVLink 450") + " | bit-exact |")
    for row in rows:
        print(f"| {row['buffer_mib']:g} MiB | {row['in_flight']} | {row['packed_of_flat']:.2f} |"
              f" {row['refit_over_flat']:.2f} | {row['flat_gbps']:.1f} | {row['packed_gbps']:.1f} |"
              f" {row['refit_gbps']:.1f} |"
              + ("" if cpu else f" {row['packed_gbps'] / NVLINK_GBPS:.2f} |")
              + f" {'yes' if row['exact'] else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
