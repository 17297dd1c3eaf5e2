"""What each process of a collective test runs: a trainer rank or a worker rank.

Module-level functions, so a 'spawn' child can import them. Each returns a plain dict the
parent asserts on; an exception is reported by its class names and message.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from rollout_fleet.adapters.collective import (
    TorchWeightReceiver, TorchWeightSender, TrainerRefitSession, init_group,
)
from rollout_fleet.adapters.collective.packing import as_bytes
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo

HOST = "127.0.0.1"


def make_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd shapes, a scalar, empty tensors, a strided one, one of ~300 KB."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(97, 13, generator=gen),
        "layer.0.q.weight": torch.randn(129, 31, generator=gen).to(torch.bfloat16),
        "layer.0.norm.weight": torch.randn(7, generator=gen).to(torch.bfloat16),
        "layer.0.empty": torch.empty(0, 5),
        "step": torch.tensor(seed * 1000 + 7, dtype=torch.int64),
        "positions": torch.randint(-2**62, 2**62, (33,), generator=gen, dtype=torch.int64),
        "layer.1.big.weight": torch.randn(300, 257, generator=gen),
        "layer.1.odd.bias": torch.randn(3, 1, 5, generator=gen).to(torch.bfloat16),
        "tail.empty": torch.zeros(3, 0, dtype=torch.bfloat16),
        "mask": torch.rand(11, generator=gen) > 0.5,
        "layer.2.transposed.weight": torch.randn(9, 300, generator=gen).t(),  # not contiguous
    }


def _outcome(run) -> dict[str, Any]:
    started = time.monotonic()
    try:
        value = run()
        return {"ok": True, "value": value, "elapsed": time.monotonic() - started}
    except BaseException as exc:  # reported to the parent, which asserts on it
        return {"ok": False, "error_types": [c.__name__ for c in type(exc).__mro__],
                "message": str(exc), "elapsed": time.monotonic() - started}


def trainer(port: int, rank: int, world_size: int, refits: list[dict], *, train_world_size: int = 1,
            timeout_s: float = 30.0, die_after_tensors: int | None = None) -> dict[str, Any]:
    def run():
        with TrainerRefitSession(HOST, port, rank, world_size, train_world_size=train_world_size,
                                 timeout_s=timeout_s) as session:
            for refit in refits:
                state = make_state_dict(refit["seed"])
                spec = CollectiveSenderSpec(buffer_bytes=refit["buffer_bytes"],
                                            num_buffers=refit["num_buffers"])
                info = refit_info_of(state)
                stream = _dying_stream(state, die_after_tensors) if die_after_tensors else state
                TorchWeightSender(session.group, spec).send(info, stream)
            return {"sent": len(refits), "is_sender": session.group.is_sender}
    return _outcome(run)


def _dying_stream(state: dict, count: int):
    for index, item in enumerate(state.items()):
        if index == count:
            os._exit(3)  # a trainer that dies mid-transfer, abruptly
        yield item


def worker(port: int, rank: int, world_size: int, refits: list[dict], *, train_world_size: int = 1,
           timeout_s: float = 30.0, info_seed_shift: int = 0, keep_all: bool = True) -> dict[str, Any]:
    def run():
        group = init_group(HOST, port, rank, world_size, "gloo", timeout_s,
                           train_world_size=train_world_size)
        report = []
        try:
            for refit in refits:
                spec = CollectiveSenderSpec(buffer_bytes=refit["buffer_bytes"],
                                            num_buffers=refit["num_buffers"])
                expected = make_state_dict(refit["seed"])
                info = refit_info_of(expected)
                if info_seed_shift:
                    info = _shifted(info)
                received = list(TorchWeightReceiver(group, spec).receive(info))
                report.append(_compare(expected, received))
        finally:
            group.close()
        return report
    return _outcome(run)


def _shifted(info: RefitInfo) -> RefitInfo:
    """The same names, one shape changed: a refit info the sender does not have."""
    wire = info.to_wire()
    wire["tensors"][0][1] = [wire["tensors"][0][1][0] + 1] + wire["tensors"][0][1][1:]
    return RefitInfo.from_wire(wire)


def _compare(expected: dict[str, torch.Tensor], received: list) -> dict[str, Any]:
    names = [name for name, _ in received]
    mismatched = [name for name, tensor in received
                  if tensor.dtype != expected[name].dtype or tensor.shape != expected[name].shape
                  or not torch.equal(as_bytes(tensor), as_bytes(expected[name]))]
    return {"names": names, "mismatched": mismatched}


def joiner(port: int, rank: int, world_size: int, *, train_world_size: int = 1,
           timeout_s: float = 30.0, backend: str = "gloo") -> dict[str, Any]:
    """Join the group and leave: for the world-size tests."""
    def run():
        group = init_group(HOST, port, rank, world_size, backend, timeout_s,
                           train_world_size=train_world_size)
        group.close()
        return "joined"
    return _outcome(run)
