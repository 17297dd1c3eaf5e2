"""A fleet worker's engine ranks receiving with vLLM's own NCCL weight-transfer engine, on the CPU.

Everything between the worker's control request and the loaded tensors is vLLM's code:
``NCCLWeightTransferInitInfo`` / ``NCCLWeightTransferUpdateInfo`` parse what the worker sends,
``worker_init_process_group`` computes each engine rank's group rank, vLLM's
``StatelessProcessGroup`` joins the trainer's store and reads the unique id the way
vLLM's NCCL communicator does, and ``receive_weights`` cuts the packed stream. Only what
needs a GPU is replaced: the NCCL communicator by gloo on the same store (it warms up with the
same one-element all-reduce), CUDA streams by no-ops, and the model by a recorder.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any

import torch
import torch.distributed as dist

from support.nemo_rl_sender import GLOO_PREFIX, TIMEOUT, digest


class GlooCommunicator:
    """What vLLM's engine asks of its communicator (``broadcast``), over gloo."""

    def __init__(self, store: Any, rank: int, world_size: int, unique_id: Any) -> None:
        self.rank = rank
        self.unique_id = unique_id
        self.broadcasts = 0
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, store), rank,
                                           world_size, TIMEOUT)
        self.group.allreduce([torch.zeros(1)]).wait()  # vLLM's communicator's first collective

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()
        self.broadcasts += 1

    def destroy(self) -> None:
        pass


def _join_like_vllm(master_address: str, master_port: int, rank: int, world_size: int,
                    device: Any) -> GlooCommunicator:
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank,
                                         world_size=world_size)
    unique_id = group.broadcast_obj(None, src=0)  # as vLLM's communicator on a rank other than 0
    return GlooCommunicator(group.store, rank, world_size, unique_id)


class _NoStream:
    def synchronize(self) -> None:
        pass


def _cpu_in_place_of_cuda() -> None:
    """vLLM's packed consumer runs on CUDA streams; on the CPU they are no-ops."""
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.stream = lambda _stream: contextlib.nullcontext()
    packed_tensor._get_streams = lambda _device, count: tuple(_NoStream() for _ in range(count))
    nccl_common.stateless_init_process_group = _join_like_vllm


class Recorder(torch.nn.Module):
    """The model: keeps what ``load_weights`` is handed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, str, list[int], str]] = []

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.loaded.append((name, str(tensor.dtype), list(tensor.shape), digest(tensor)))


def _engine_rank(engine_rank: int, ranks: int, init_info: dict, update_info: dict) -> dict:
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferEngine, NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo,
    )

    parallel = types.SimpleNamespace(data_parallel_index=0, world_size=ranks, rank=engine_rank)
    recorder = Recorder()
    engine = NCCLWeightTransferEngine(
        WeightTransferConfig(backend="nccl"),
        types.SimpleNamespace(parallel_config=parallel, model_config=None),
        torch.device("cpu"), recorder)
    engine.init_transfer_engine(NCCLWeightTransferInitInfo(**init_info))
    engine.receive_weights(NCCLWeightTransferUpdateInfo(**update_info))
    group = engine.model_update_group
    unique_id = group.unique_id
    return {"rank": group.rank, "buffers": group.broadcasts, "loaded": recorder.loaded,
            "unique_id": bytes(unique_id).hex(),
            "unique_id_type": f"{type(unique_id).__module__}.{type(unique_id).__qualname__}"}


def worker(init_info: dict, update_info: dict, ranks: int) -> dict:
    """One worker: its ``ranks`` engine ranks receive at once (threads in place of vLLM's
    worker processes)."""
    try:
        _cpu_in_place_of_cuda()
        outcomes: list[Any] = [None] * ranks

        def run(rank: int) -> None:
            try:
                outcomes[rank] = _engine_rank(rank, ranks, init_info, update_info)
            except Exception as error:  # reported to the test
                outcomes[rank] = {"error": f"{type(error).__name__}: {error}"}

        threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return {"ok": all("error" not in o for o in outcomes), "ranks": outcomes}
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
