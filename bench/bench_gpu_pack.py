"""Packing and unpacking a refit's state dict on one GPU vs a plain device-to-device copy.

    python3 bench/bench_gpu_pack.py [--sizes 1,8] [--buffer-mib 256,1024] [--reps 5]

A bf16 state dict of Llama-like layer shapes (~1 GiB: Llama-3.2-1B layers; ~8 GiB: Llama-3-8B
layers plus the embedding) is cut by the core's bucket plan. Every method moves the same bytes;
each is timed with CUDA events (median of --reps after warm-ups) and printed as GB/s and as a
ratio to one flat copy of the same byte count (1.00 = as fast as the floor).

pack:   tensors -> packed buffers (what the sender does per bucket)
unpack: packed buffers -> each parameter (what an engine's weight load does per bucket; the
        receiver itself hands out views, no copy)
Methods: loop (one copy_ per tensor), foreach (one torch._foreach_copy_ per bucket), cat (one
torch.cat into the buffer, padding included), widest foreach (one _foreach_copy_ per bucket
over the widest integer view the sizes allow, mostly int64), typed targets (copy_ per tensor
into a view of the buffer in the tensor's own dtype and shape), views prebuilt (only the copy_
launches: the floor of any per-tensor loop), adapter (what adapters/collective/packing.py does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def import_package():
    """Import rollout_fleet, also where it is not installed (the GPU machine): a path shim."""
    try:
        import rollout_fleet.core  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp()) / "rollout_fleet"
        shim.mkdir()
        (shim / "__init__.py").write_text("")
        for layer in ("core", "ports", "adapters"):
            os.symlink(REPO / layer, shim / layer)
        sys.path.insert(0, str(shim.parent))


import_package()
from rollout_fleet.adapters.collective import packing  # noqa: E402
from rollout_fleet.core.refit import BUFFER_ALIGN, plan_buckets  # noqa: E402
from rollout_fleet.adapters.collective.transfer import refit_info_of  # noqa: E402
from llama_shapes import layer_shapes  # noqa: E402  (bench/, the script's own folder)

MODELS = {
    0: ("tiny (a dry run)", 256, 1024, 64, 2, 1000),
    # name: (hidden, intermediate, kv_dim, layers, vocab or 0 for no embedding)
    1: ("llama-3.2-1b-like x8 layers", 2048, 8192, 512, 8, 0),
    8: ("llama-3-8b-like x17 layers + embedding", 4096, 14336, 1024, 17, 128256),
}


def state_dict(size_gib: int, device: torch.device) -> dict[str, torch.Tensor]:
    _, hidden, inter, kv, layers, vocab = MODELS[size_gib]
    shapes: dict[str, tuple[int, ...]] = {}
    if vocab:
        shapes["model.embed_tokens.weight"] = (vocab, hidden)
    for i in range(layers):
        shapes.update(layer_shapes(i, hidden, inter, kv))
    shapes["model.norm.weight"] = (hidden,)
    gen = torch.Generator(device=device).manual_seed(0)
    return {n: torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16)
            for n, s in shapes.items()}


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, after two warm-ups, by CUDA events."""
    for _ in range(2):
        fn()
    times = []
    if not torch.cuda.is_available():  # a dry run of the bench's logic on a CPU
        import time
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def pack_loop(buf, bucket, tensors):
    for entry, t in zip(bucket.entries, tensors):
        if entry.meta.nbytes:
            buf[entry.offset:entry.offset + entry.meta.nbytes].copy_(t.reshape(-1).view(torch.uint8))


def typed_targets(buf, bucket):
    return [buf[e.offset:e.offset + e.meta.nbytes].view(packing.torch_dtype(e.meta.dtype))
            .view(e.meta.shape) for e in bucket.entries if e.meta.nbytes]


def pack_loop_typed(buf, bucket, tensors):
    """Targets viewed as the tensor's own dtype and shape: no per-source view ops."""
    for target, t in zip(typed_targets(buf, bucket), tensors):
        target.copy_(t)


def pack_loop_prebuilt(pairs):
    """Only the copy_ launches: every view built beforehand (the Python floor of a loop)."""
    for target, t in pairs:
        target.copy_(t)


def pack_foreach(buf, bucket, tensors):
    dst = [buf[e.offset:e.offset + e.meta.nbytes] for e in bucket.entries if e.meta.nbytes]
    src = [t.reshape(-1).view(torch.uint8) for e, t in zip(bucket.entries, tensors) if e.meta.nbytes]
    torch._foreach_copy_(dst, src)


def pack_foreach_wide(buf, bucket, tensors):
    """_foreach_copy_ over 2-byte elements: does the uint8 element size slow the kernel?"""
    dst = [buf[e.offset:e.offset + e.meta.nbytes].view(torch.int16)
           for e in bucket.entries if e.meta.nbytes]
    src = [t.reshape(-1).view(torch.int16) for e, t in zip(bucket.entries, tensors)
           if e.meta.nbytes]
    torch._foreach_copy_(dst, src)


def pack_cat(buf, bucket, tensors):
    parts, end = [], 0
    pad = torch.zeros(BUFFER_ALIGN, dtype=torch.uint8, device=buf.device)
    for entry, t in zip(bucket.entries, tensors):
        if entry.offset > end:
            parts.append(pad[:entry.offset - end])
        if entry.meta.nbytes:
            parts.append(t.reshape(-1).view(torch.uint8))
            end = entry.offset + entry.meta.nbytes
    torch.cat(parts, out=buf[:end])


def adapter_with_cat_group(group, buf, per_bucket):
    """The adapter's packing with another number of tensors per cat (0: the whole bucket)."""
    def run():
        saved, packing.CAT_GROUP = packing.CAT_GROUP, group
        try:
            for b, ts, _ in per_bucket:
                packing.pack_bucket(buf, b, ts)
        finally:
            packing.CAT_GROUP = saved
    return run


def unpack_loop(buf, bucket, params):
    for (name, view), p in zip(packing.unpack_bucket(buf, bucket), params):
        p.copy_(view)


def unpack_foreach(buf, bucket, params):
    torch._foreach_copy_(params, [v for _, v in packing.unpack_bucket(buf, bucket)])


def unpack_split(buf, bucket, params):
    packing.copy_tensors(params, [v for _, v in packing.unpack_bucket(buf, bucket)])


_WIDTHS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def widest_copy(targets, sources):
    """One _foreach_copy_ per width, over the widest integer view sizes and addresses allow."""
    groups = {}
    for target, source in zip(targets, sources):
        target, source = target.reshape(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
        dtype = next((d for d, w in _WIDTHS if target.numel() % w == 0
                      and target.data_ptr() % w == 0 and source.data_ptr() % w == 0), torch.uint8)
        dsts, srcs = groups.setdefault(dtype, ([], []))
        dsts.append(target.view(dtype))
        srcs.append(source.view(dtype))
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


def pack_widest(buf, bucket, tensors):
    widest_copy([buf[e.offset:e.offset + e.meta.nbytes] for e in bucket.entries if e.meta.nbytes],
                [t for e, t in zip(bucket.entries, tensors) if e.meta.nbytes])


def unpack_widest(buf, bucket, params):
    widest_copy(params, [v for _, v in packing.unpack_bucket(buf, bucket)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,8")
    parser.add_argument("--buffer-mib", default="256,1024")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda")
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)},"
              f" CUDA {torch.version.cuda}")
    else:
        device = torch.device("cpu")
        print(f"torch {torch.__version__}, no GPU: a dry run on the CPU")
    for size in (int(s) for s in args.sizes.split(",")):
        sd = state_dict(size, device)
        info = refit_info_of(sd)
        total = info.total_bytes
        tensors = list(sd.values())
        flat_src = torch.empty(total, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        floor = timed(lambda: flat_dst.copy_(flat_src), args.reps)
        print(f"\n{MODELS[size][0]}: {len(tensors)} tensors, {total / 2**30:.2f} GiB bf16;"
              f" flat D2D copy {total / floor / 1e9:.0f} GB/s ({floor * 1e3:.2f} ms)")
        params = [torch.empty_like(t) for t in tensors]
        for mib in (int(m) for m in args.buffer_mib.split(",")):
            plan = plan_buckets(info.tensors, mib << 20)
            buf = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=device)
            per_bucket, start = [], 0
            for bucket in plan:
                per_bucket.append((bucket, tensors[start:start + len(bucket.entries)],
                                   params[start:start + len(bucket.entries)]))
                start += len(bucket.entries)
            methods = {
                "pack loop": lambda: [pack_loop(buf, b, ts) for b, ts, _ in per_bucket],
                "pack loop typed targets": lambda: [pack_loop_typed(buf, b, ts)
                                                    for b, ts, _ in per_bucket],
                "pack loop views prebuilt": lambda: [pack_loop_prebuilt(pairs)
                                                     for pairs in prebuilt],
                "pack foreach": lambda: [pack_foreach(buf, b, ts) for b, ts, _ in per_bucket],
                "pack foreach 2-byte": lambda: [pack_foreach_wide(buf, b, ts)
                                                for b, ts, _ in per_bucket],
                "pack cat": lambda: [pack_cat(buf, b, ts) for b, ts, _ in per_bucket],
                "pack widest foreach": lambda: [pack_widest(buf, b, ts)
                                                 for b, ts, _ in per_bucket],
                "pack (adapter)": lambda: [packing.pack_bucket(buf, b, ts)
                                           for b, ts, _ in per_bucket],
                **{f"pack (adapter, cat groups of {g})": adapter_with_cat_group(g, buf, per_bucket)
                   for g in (4, 16, 0)},
                "unpack loop": lambda: [unpack_loop(buf, b, ps) for b, _, ps in per_bucket],
                "unpack foreach": lambda: [unpack_foreach(buf, b, ps) for b, _, ps in per_bucket],
                "unpack (adapter)": lambda: [unpack_split(buf, b, ps) for b, _, ps in per_bucket],
                "unpack widest foreach": lambda: [unpack_widest(buf, b, ps)
                                                   for b, _, ps in per_bucket],
            }
            prebuilt = [list(zip(typed_targets(buf, b), ts)) for b, ts, _ in per_bucket]
            check_packing(plan, per_bucket, buf)
            print(f"  buffer {mib} MiB ({len(plan)} buckets):")
            for name, fn in methods.items():
                seconds = timed(fn, args.reps)
                print(f"    {name:32s} {total / seconds / 1e9:7.0f} GB/s"
                      f"  {seconds * 1e3:8.2f} ms  ratio to flat copy {floor / seconds:5.2f}")
            del buf
        del sd, tensors, params, flat_src, flat_dst
        if device.type == "cuda":
            torch.cuda.empty_cache()


def check_packing(plan, per_bucket, buf) -> None:
    """Every method packs the same bytes, and unpacking gives every tensor back bit-exact."""
    for bucket, tensors, params in per_bucket[:2] + per_bucket[-1:]:
        reference = None
        for pack in (pack_loop, pack_loop_typed, pack_foreach, pack_foreach_wide, pack_cat,
                     packing.pack_bucket):
            buf.zero_()
            pack(buf, bucket, tensors)
            packed = buf[:bucket.nbytes].clone()
            reference = packed if reference is None else reference
            assert torch.equal(packed, reference), f"{pack.__name__} packs other bytes"
        unpack_split(buf, bucket, params)
        assert all(torch.equal(p.view(torch.int16), t.view(torch.int16))
                   for p, t in zip(params, tensors)), "unpacking lost bytes"


if __name__ == "__main__":
    main()
