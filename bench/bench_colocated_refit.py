"""Colocated refit (trainer and engine on one device, shared buffers) side by side with the
floor and with the packed refit over gloo.

    python3 bench/bench_colocated_refit.py                   # CPU: shared memory, and gloo
    python3 bench/bench_colocated_refit.py --device cuda     # one GPU: CUDA IPC (no gloo column)
    [--size 0|1|8|cpu] [--buffer-mib 8,32] [--num-buffers 2] [--reps 5]

Two processes on one device. The trainer holds a Llama-style model (bench_gpu_refit's
``LlamaLike``: float32 on the CPU, bf16 on a GPU) and refits the engine's copy of it with the
project's ``ColocatedSender``; the engine runs ``ColocatedTransferEngine``, the class vLLM's
worker runs for this protocol, standalone over a plain torch model (each tensor copied into its
parameter: what vLLM's layerwise reload does for an unquantised model), behind the worker's
real colocated controls (``WorkerColocatedRefit``); the control calls cross a pipe instead of
HTTP. Per rep, interleaved, after one warm-up (medians printed):
  copy:       in the trainer's process, one ``copy_`` of every tensor into a second model
              (a plain memcpy on the CPU, a device-to-device copy on a GPU): the floor
  staged:     in the trainer's process, every tensor copied into one buffer and out of it
              into the second model: the two copies a packed handoff makes, with no second
              process, no handle and no control call (this design's floor)
  colocated:  start -> every bucket packed by the trainer, loaded by the engine -> finish
              (also printed: the trainer's seconds packing, and waiting for the engine)
  in place:   the same refit from a second copy of the model whose tensors the sender holds
              in place (``make_resident``: one buffer per bucket): no packing, the engine's
              load the only copy, through a transfer engine of its own over the same model
              (an engine keeps one sender's buffers open; the other columns' refits would
              close them between its reps); from the second refit on, it replays the first
              one's recorded copies (``adapters/vllm/inside/load_replay.py``; printed: "its load:
              replayed", or why not)
  NeMo-RL:    NeMo-RL's own colocated protocol into the same engine: its sender restated
              (support/nemo_rl_ipc_sender.py: ZeroMQ, two buffers of this size, fresh
              each refit, 512-byte offsets) and the worker's receiver (core/ipc_stream.py over
              adapters/ipc_zmq), as ``update_weights_via_ipc_zmq`` runs them
  packed:     (CPU) the packed refit over gloo between the same two processes, received and
              loaded by ``PackedTransferEngine`` (NCCL refuses two ranks on one GPU)
After the reps the engine's weights are compared with the trainer's, byte for byte (for the
buffered, the in-place and NeMo-RL's refit alike: new weights, then one refit, then the digests).
The NeMo-RL column needs pyzmq (on the GPU machine: the bundle's site folder on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # support
from bench_gpu_pack import import_package  # noqa: E402
from bench_gpu_refit import MODELS, LlamaLike, _free_port  # noqa: E402

import_package()
from rollout_fleet.adapters.collective import init_group, join_receiver  # noqa: E402
from rollout_fleet.adapters.collective.colocated import open_buffer  # noqa: E402
from rollout_fleet.adapters.collective.colocated_sender import ColocatedSender  # noqa: E402
from rollout_fleet.adapters.collective.transfer import refit_info_of  # noqa: E402
from rollout_fleet.adapters.collective.transfer import TorchWeightSender  # noqa: E402
from rollout_fleet.adapters.vllm.inside.colocated_engine import compose_colocated_engine  # noqa: E402
from rollout_fleet.adapters.vllm.messages import PackedInitInfo  # noqa: E402
from rollout_fleet.core.colocated_service import WorkerColocatedRefit  # noqa: E402
from rollout_fleet.core.ipc_stream import receive_weight_stream  # noqa: E402
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin  # noqa: E402
from rollout_fleet.ports.colocated import ColocatedTarget  # noqa: E402
from rollout_fleet.wiring.demo.colocated import load_kind  # noqa: E402

# A CPU-sized model: 4 layers, hidden 1024, 32k vocabulary (~300 MiB in float32).
MODELS = {**MODELS, "cpu": ("llama-like, 4 layers, hidden 1024, 32k vocabulary", 1024, 2816,
                            16, 4, 4, 32000, False)}


def colocated_engine_over(model, device):
    """``ColocatedTransferEngine`` composed as wiring/vllm_transfer.py composes it (the collective
    adapter's receiver and buffer opener), but on no vLLM base class, so it runs where vLLM is not
    installed. Given no vLLM config, it loads each tensor into the model in place."""
    return compose_colocated_engine(object, join_receiver, open_buffer)(None, None, device, model)


class StandaloneColocated(ColocatedTarget):
    """The engine side without vLLM: the transfer engine over a plain model (vLLM's adapter
    does the same begin/bucket/end through vLLM's worker)."""

    def __init__(self, model, device):
        self.model = model
        self.transfer = colocated_engine_over(model, device)
        self.version = 0
        # vLLM's adapter keeps its parameters' metas from the engine's start; so does this
        self.metas = {t.name: t for t in refit_info_of(model.state_dict()).tensors}

    def colocated_transports(self):
        return ("cuda",) if self.transfer.device.type == "cuda" else ("shm",)

    def weight_metas(self):
        return self.metas

    def weight_version(self):
        return self.version

    async def begin_colocated(self, manifest, *, mode, keep_buffers=False):
        self.transfer.start_weight_update()
        self.transfer.update_weights({"colocated": {"begin": {
            "refit_info": manifest.info.to_wire(), "rollback": "none",
            "keep_buffers": keep_buffers}}})

    async def load_colocated_bucket(self, bucket, handle):
        self.transfer.update_weights({"colocated": {"bucket": {
            "tensors": [[e.meta.name, e.offset] for e in bucket.entries],
            "nbytes": bucket.nbytes, "handle": handle.to_wire()}}})

    async def load_colocated_buckets(self, buckets):
        self.transfer.update_weights({"colocated": {"buckets": [{
            "tensors": [[e.meta.name, e.offset] for e in bucket.entries],
            "nbytes": bucket.nbytes, "handle": handle.to_wire()} for bucket, handle in buckets]}})

    async def end_colocated(self, *, version):
        self.transfer.update_weights({"colocated": {"end": {}}})
        self.transfer.finish_weight_update()
        self.model.prefix_cache.clear()
        self.version = version or self.version + 1
        return self.version

    async def abandon_colocated(self, reason):
        self.transfer.update_weights({"colocated": {"abort": reason}})
        self.transfer.finish_weight_update()

    def colocated_stats(self):
        stats = self.transfer.stats
        return {"mapped_peak_bytes": stats.mapped_peak_bytes,
                "opened_buffers": stats.opened_buffers, "replayed": stats.replayed,
                "replay_refusal": stats.replay_refusal}

    async def release_colocated(self):
        self.transfer.release_kept_buffers()


class PipeControl:
    """The trainer's WorkerControl: each call crosses the pipe to the engine process."""

    worker_id = "engine"

    def __init__(self, connection, target="main"):
        self.connection, self.target = connection, target

    async def call(self, name, body, *, timeout_s=None):
        self.connection.send(("control", name, body, self.target))
        kind, answer = await asyncio.to_thread(self.connection.recv)
        if kind == "error":
            raise RuntimeError(answer)
        return answer


def device_of(args):
    return torch.device("cuda:0" if args.device == "cuda" else "cpu")


def built_model(args, seed: int):
    """The bench's model (``--size``) on its device, in its dtype, with weights from ``seed``."""
    _name, *shape = MODELS[args.size]
    model = LlamaLike(*shape, device=device_of(args), dtype=dtype_of(args))
    model.randomize(seed=seed)
    return model


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _staged_copy(state, copy, staging, device) -> float:
    started = time.perf_counter()
    for name, tensor in state.items():
        block = staging[:_nbytes(tensor)]
        block.copy_(tensor.reshape(-1).view(torch.uint8))
        copy[name].view(-1).view(torch.uint8).copy_(block)
    synchronize(device)
    return time.perf_counter() - started


def _digest(state) -> str:
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def trainer(args, connection):
    device = device_of(args)
    model = built_model(args, seed=1)
    state = model.state_dict()
    copy = {n: torch.empty_like(t) for n, t in state.items()}
    nbytes = refit_info_of(state).total_bytes
    resident_model = built_model(args, seed=1)
    rows = []
    for mib in args.buffer_mib:
        times = {"copy": [], "staged": [], "colocated": [], "pack": [], "wait": [], "packed": [],
                 "in_place": [], "nemo_rl": []}
        replays = []  # per timed in-place refit: "replayed", or why its load was not
        staging = torch.empty(max(int(mib * 2**20), max(_nbytes(t) for t in state.values())),
                              dtype=torch.uint8, device=device)
        sender = ColocatedSender(PipeControl(connection), buffer_bytes=int(mib * 2**20),
                                 num_buffers=args.num_buffers, device=device)
        in_place = ColocatedSender(PipeControl(connection, "in_place"),
                                   buffer_bytes=int(mib * 2**20), device=device)
        in_place.make_resident(resident_model.weights)
        group = sender_packed = None
        if device.type == "cpu":
            port = _free_port()
            connection.send(("join", port, int(mib * 2**20)))
            group = init_group("127.0.0.1", port, 0, 2, "gloo", 120.0)
            sender_packed = TorchWeightSender(group, CollectiveSenderSpec(
                buffer_bytes=int(mib * 2**20), num_buffers=args.num_buffers))
        for rep in range(args.reps + 1):
            started = time.perf_counter()
            for name, tensor in state.items():
                copy[name].copy_(tensor)
            synchronize(device)
            copy_s = time.perf_counter() - started
            staged_s = _staged_copy(state, copy, staging, device)
            result = sender.send(state)
            in_place_result = in_place.send(resident_model.state_dict())
            in_place_s = in_place_result.seconds
            nemo_rl_s = _nemo_rl_refit(connection, state, mib, device)
            packed_s = None
            if sender_packed is not None:
                started = time.perf_counter()
                connection.send(("packed",))
                sender_packed.send(refit_info_of(state), state)
                assert connection.recv() == ("done", "packed")
                packed_s = time.perf_counter() - started
            if rep:
                times["copy"].append(copy_s)
                times["staged"].append(staged_s)
                times["colocated"].append(result.seconds)
                times["pack"].append(result.pack_s)
                times["wait"].append(result.wait_s)
                times["in_place"].append(in_place_s)
                replays.append(load_kind(in_place_result.engine))
                times["nemo_rl"].append(nemo_rl_s)
                if packed_s is not None:
                    times["packed"].append(packed_s)
        model.randomize(seed=7 + len(rows))  # new weights: every byte must move
        sender.send(state)
        connection.send(("digest",))
        exact = connection.recv() == ("digest", _digest(state))
        resident_model.randomize(seed=70 + len(rows))  # in place, as an optimizer steps
        assert in_place.send(resident_model.state_dict()).moved_tensors == 0
        connection.send(("digest",))
        exact = exact and connection.recv() == ("digest", _digest(resident_model.state_dict()))
        in_place.close()
        model.randomize(seed=170 + len(rows))
        _nemo_rl_refit(connection, state, mib, device)
        connection.send(("digest",))
        exact = exact and connection.recv() == ("digest", _digest(state))
        resident_model = built_model(args, seed=1)  # its own memory
        sender.close()
        if sender_packed is not None:
            sender_packed.close()
            connection.send(("leave",))
            group.close()
        rows.append({**_row(mib, nbytes, times, exact, result),
                     "in_place_load": ", ".join(sorted(set(replays)))})
        print(_format(rows[-1]), flush=True)
    connection.send(("quit",))
    return rows, nbytes


def _nemo_rl_refit(connection, state, mib, device) -> float:
    """One refit through NeMo-RL's stream: the trainer rank binds, the engine connects and
    loads every buffer; seconds from the bind to the final answer."""
    from support.nemo_rl_ipc_sender import TrainerRank

    address = f"ipc://{tempfile.gettempdir()}/bench-colocated-{os.getpid()}.sock"
    started = time.perf_counter()
    rank = TrainerRank(address, state.items(), int(2 * mib * 2**20), timeout_s=120.0,
                       device=device)
    connection.send(("nemo_rl", address))
    kind, answer = connection.recv()
    rank.join()
    if kind != "done":
        raise RuntimeError(f"NeMo-RL's stream failed in the engine: {answer}")
    return time.perf_counter() - started


async def _receive_nemo_rl(target, address, info, device):
    from rollout_fleet.adapters.ipc_zmq import ZmqWeightStream

    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    async with ZmqWeightStream(address, timeout_s=120.0, device_uuid=uuid) as stream:
        return await receive_weight_stream(stream, target, info)


def engine(args, connection):
    device = device_of(args)
    model = built_model(args, seed=2)
    target = StandaloneColocated(model, device)
    # The in-place sender gets a transfer engine of its own over the same model: an engine
    # keeps one sender's buffers open across refits, and the other columns' refits between
    # its reps would close them (a trainer refits through one sender).
    controls = {"main": WorkerColocatedRefit(target).controls(),
                "in_place": WorkerColocatedRefit(StandaloneColocated(model, device)).controls()}
    loop = asyncio.new_event_loop()
    packed = None
    info = refit_info_of(model.state_dict())
    while True:
        message = connection.recv()
        if message[0] == "control":
            try:
                control = controls[message[3]][message[1]]
                connection.send(("ok", loop.run_until_complete(control(message[2]))))
            except Exception as error:  # noqa: BLE001 - the trainer reports it
                connection.send(("error", f"{type(error).__name__}: {error}"))
        elif message[0] == "join":
            spec = CollectiveSenderSpec(buffer_bytes=message[2], num_buffers=args.num_buffers)
            join = GroupJoin(host="127.0.0.1", port=message[1], world_size=2, train_world_size=1,
                             first_rank=1, ranks_per_worker=1, sender_spec=spec, backend="gloo",
                             timeout_s=120.0)
            packed = colocated_engine_over(model, device)
            packed.init_transfer_engine(PackedInitInfo(join))
        elif message[0] == "packed":
            packed.start_weight_update()
            packed.update_weights({"refit_info": info.to_wire()})
            packed.finish_weight_update()
            connection.send(("done", "packed"))
        elif message[0] == "leave":
            packed.shutdown()
        elif message[0] == "nemo_rl":
            try:
                version = loop.run_until_complete(
                    _receive_nemo_rl(target, message[1], info, device))
                connection.send(("done", version))
            except Exception as error:  # noqa: BLE001 - the trainer reports it
                connection.send(("error", f"{type(error).__name__}: {error}"))
        elif message[0] == "digest":
            connection.send(("digest", _digest(model.state_dict())))
        elif message[0] == "quit":
            return


def dtype_of(args):
    return torch.float32 if args.device == "cpu" else torch.bfloat16


def _row(mib, nbytes, times, exact, result):
    med = {k: statistics.median(v) for k, v in times.items() if v}
    row = {"buffer_mib": mib, "reps": len(times["copy"]), "exact": exact, "nbytes": nbytes,
           "pool_mib": result.pool_bytes / 2**20, **{f"{k}_s": v for k, v in med.items()}}
    row["colocated_over_copy"] = med["colocated"] / med["copy"]
    row["in_place_over_copy"] = med["in_place"] / med["copy"]
    row["nemo_rl_over_copy"] = med["nemo_rl"] / med["copy"]
    row["nemo_rl_over_in_place"] = med["nemo_rl"] / med["in_place"]
    row["staged_over_copy"] = med["staged"] / med["copy"]
    if "packed" in med:
        row["packed_over_copy"] = med["packed"] / med["copy"]
        row["packed_over_colocated"] = med["packed"] / med["colocated"]
    return row


def _format(row):
    text = (f"  buffers {row['buffer_mib']:g} MiB (pool {row['pool_mib']:.1f} MiB): copy"
            f" {row['copy_s'] * 1e3:.1f} ms, staged {row['staged_s'] * 1e3:.1f} ms"
            f" ({row['staged_over_copy']:.2f}x copy), colocated {row['colocated_s'] * 1e3:.1f} ms"
            f" ({row['colocated_over_copy']:.2f}x copy; trainer packing {row['pack_s'] * 1e3:.1f}"
            f" ms, waiting {row['wait_s'] * 1e3:.1f} ms), in place {row['in_place_s'] * 1e3:.1f} ms"
            f" ({row['in_place_over_copy']:.2f}x copy; its load: {row['in_place_load']}), NeMo-RL's stream {row['nemo_rl_s'] * 1e3:.1f}"
            f" ms ({row['nemo_rl_over_copy']:.2f}x copy, {row['nemo_rl_over_in_place']:.2f}x in place)")
    if "packed_s" in row:
        text += (f", packed gloo {row['packed_s'] * 1e3:.1f} ms ({row['packed_over_copy']:.2f}x"
                 f" copy, {row['packed_over_colocated']:.2f}x colocated)")
    return text + f"; bit-exact: {'yes' if row['exact'] else 'NO'}"


def _run(role, args, connections, results):
    if role == 0:
        results.put(trainer(args, connections[0]))
    else:
        engine(args, connections[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", default=None, help="model: cpu (default on the CPU), 0, 1, 8")
    parser.add_argument("--buffer-mib", default=None, help="comma-separated MiB per buffer")
    parser.add_argument("--num-buffers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    args.size = args.size or ("cpu" if args.device == "cpu" else "1")
    args.size = args.size if args.size == "cpu" else int(args.size)
    args.buffer_mib = [float(m) for m in (args.buffer_mib or ("8,32" if args.device == "cpu"
                                                              else "256,1024")).split(",")]
    context = mp.get_context("spawn")
    connections, results = context.Pipe(), context.SimpleQueue()
    print(f"torch {torch.__version__}, {args.device}; {MODELS[args.size][0]}", flush=True)
    mp.start_processes(_run, args=(args, connections, results), nprocs=2, start_method="spawn")
    rows, nbytes = results.get()
    print(f"\n{nbytes / 2**20:.0f} MiB, medians of {rows[0]['reps']} reps")
    print("| buffers | copy ms | staged / copy | colocated ms | colocated / copy | in place ms"
          " | in place / copy | NeMo-RL ms | NeMo-RL / copy | NeMo-RL / in place | packed gloo ms | packed / copy | packed / colocated | bit-exact |")
    for r in rows:
        print(f"| {r['buffer_mib']:g} MiB x {args.num_buffers} | {r['copy_s'] * 1e3:.1f} |"
              f" {r['staged_over_copy']:.2f} | {r['colocated_s'] * 1e3:.1f} | {r['colocated_over_copy']:.2f} |"
              f" {r['in_place_s'] * 1e3:.1f} | {r['in_place_over_copy']:.2f} |"
              f" {r['nemo_rl_s'] * 1e3:.1f} | {r['nemo_rl_over_copy']:.2f} | {r['nemo_rl_over_in_place']:.2f} |"
              f" {r.get('packed_s', float('nan')) * 1e3:.1f} | {r.get('packed_over_copy', float('nan')):.2f} |"
              f" {r.get('packed_over_colocated', float('nan')):.2f} | {'yes' if r['exact'] else 'NO'} |")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
