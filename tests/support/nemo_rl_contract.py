"""What NeMo-RL's GRPO loop expects of a generation backend, restated for the replay.

Written in this project's own words from reading NeMo-RL's source at commit 7ea279ab
(``nemo_rl/distributed/batched_data_dict.py``, ``nemo_rl/models/generation/interfaces.py``,
``nemo_rl/models/generation/dynamo/config.py``,
``nemo_rl/weight_sync/collective_weight_synchronizer.py``); no code of it is copied. Each piece
does what NeMo-RL's does on the paths the replay takes:

- ``TensorBatch``: NeMo-RL's batch type as the replay uses it: a dict of tensors and lists that
  joins per-sample batches into one and knows its size;
- ``require_right_padded``: the padding check NeMo-RL runs on a batch going in and coming out;
- ``check_dynamo_generation_config`` (in ``nemo_rl_config_checks``): the checks NeMo-RL applies
  to ``policy.generation`` before it builds a Dynamo backend;
- ``CollectiveRefit``: the weight synchroniser of a non-colocated run: the order of its calls
  on the trainer's policy and on the backend, and how it waits on their futures;
- ``STEP_HOOKS``: the backend's newer hooks NeMo-RL's GRPO step calls around its rollouts
  (newer sources in the code search: ``algorithms/grpo.py``, ``generation/interfaces.py``).
"""

from __future__ import annotations

from collections import UserDict
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch


# In NeMo-RL's order within one GRPO step: before the rollouts (the first generation batch of
# the step), then after ``finish_generation``, then once the step's rewards are in.
STEP_HOOKS = ("snapshot_step_metrics", "clear_logger_metrics", "get_logger_metrics",
              "get_step_metrics")


class TensorBatch(UserDict):
    """A batch: per key a tensor (rows first) or a list with one item per row."""

    @classmethod
    def join(cls, parts: Sequence[Mapping[str, Any]],
             pad_values: Mapping[str, int | float] | None = None) -> "TensorBatch":
        """The parts' rows one after another, keys in sorted order. Lists are chained, 1-D
        tensors concatenated, and wider tensors right-padded along their second axis to the
        widest part (with ``pad_values[key]``, 0 when not given) before they are stacked."""
        joined = cls()
        pads = dict(pad_values or {})
        for key in sorted({key for part in parts for key in part}):
            values = [part[key] for part in parts if key in part]
            joined[key] = _join_values(key, values, pads.get(key, 0))
        return joined

    def size(self) -> int:
        """Rows in the batch, read from its first key (0 when it holds nothing)."""
        if not self.data:
            return 0
        first = next(iter(self.data.values()))
        return first.shape[0] if torch.is_tensor(first) else len(first)


def _join_values(key: str, values: list[Any], pad: int | float) -> Any:
    if isinstance(values[0], list):
        return [item for value in values for item in value]
    if not all(torch.is_tensor(value) for value in values):
        raise TypeError(f"cannot join {key!r}: {type(values[0]).__name__} is neither a tensor "
                        "nor a list")
    if all(value.ndim == 1 for value in values):
        return torch.cat(values)
    width = max(value.shape[1] for value in values)
    padded = [_pad_second_axis(value, width, pad) for value in values]
    return torch.cat(padded, dim=0)


def _pad_second_axis(value: torch.Tensor, width: int, pad: int | float) -> torch.Tensor:
    shape = list(value.shape)
    shape[1] = width
    out = torch.full(shape, pad, dtype=value.dtype)
    out[:, :value.shape[1]] = value
    return out


def right_padding_problem(batch: Any, pad: int | None) -> str | None:
    """Why ``batch`` is not right-padded with ``pad``, or None when it is. A prompt batch is
    read through (input_ids, input_lengths), an output batch through (output_ids,
    unpadded_sequence_lengths)."""
    if not isinstance(batch, TensorBatch):
        raise TypeError(f"the padding check takes a TensorBatch, not {type(batch).__name__}")
    if pad is None:
        raise ValueError("the pad token id is None: the tokenizer must define one")
    for ids_key, lengths_key in (("input_ids", "input_lengths"),
                                 ("output_ids", "unpadded_sequence_lengths")):
        if ids_key in batch and lengths_key in batch:
            return _padding_problem(batch[ids_key], batch[lengths_key], pad)
    return (f"the batch holds neither (input_ids, input_lengths) nor (output_ids, "
            f"unpadded_sequence_lengths); its keys: {sorted(batch.keys())}")


def _padding_problem(ids: torch.Tensor, lengths: torch.Tensor, pad: int) -> str | None:
    if ids.ndim != 2:
        return f"token ids must be 2-D, got shape {list(ids.shape)}"
    rows, width = ids.shape
    if lengths.shape[0] != rows:
        return f"{lengths.shape[0]} lengths for {rows} rows"
    for row in range(rows):
        length = int(lengths[row].item())
        if length > width:
            return f"row {row}: length {length} is beyond the width {width}"
        tail = ids[row, length:]
        if bool((tail != pad).any()):
            positions = (torch.nonzero(tail != pad).flatten() + length).tolist()
            return f"row {row}: tokens other than the pad after its length, at {positions}"
    return None


def require_right_padded(batch: Any, pad: int | None) -> None:
    """NeMo-RL's check as its generation backends run it: a problem raises ValueError."""
    problem = right_padding_problem(batch, pad)
    if problem is not None:
        raise ValueError(f"not right-padded: {problem}")


class CollectiveRefit:
    """The weight synchroniser of a non-colocated run, driving a trainer's ``policy`` and a
    generation backend; the two clusters give the collective's address and ranks."""

    def __init__(self, policy: Any, generation: Any, train_cluster: Any,
                 inference_cluster: Any) -> None:
        self.policy = policy
        self.generation = generation
        self.train_cluster = train_cluster
        self.inference_cluster = inference_cluster
        self.is_stale = True  # nothing sent yet: the backend's weights are not the trainer's

    def init_communicator(self) -> None:
        """Refit info first (trainer to backend, in the payload mode the backend asks for),
        then both sides join one collective: trainer ranks first, then the backend's, waited
        on together."""
        mode = self.generation.get_refit_payload_mode()
        self.generation.prepare_refit_info(self.policy.prepare_refit_info(refit_payload_mode=mode))
        address, port = self.train_cluster.get_master_address_and_port()
        trainer_ranks = self.train_cluster.world_size()
        backend_ranks = self.generation.get_inference_world_size()
        if backend_ranks is None:
            backend_ranks = self.inference_cluster.world_size()
        ranks = trainer_ranks + backend_ranks
        spec = self.generation.get_collective_sender_spec()
        joining = self.policy.init_collective(address, port, ranks,
                                              train_world_size=trainer_ranks,
                                              nccl_peer=spec.nccl_peer)
        joining += self.generation.init_collective(address, port, ranks,
                                                   train_world_size=trainer_ranks)
        ray.get(joining)

    def sync_weights(self, *, timer: Any = None,
                     kv_scales: dict[str, float] | None = None) -> dict[str, float]:
        """The trainer broadcasts with the backend's buffer geometry while the backend
        receives; the trainer's futures are waited on first, then the backend's answers,
        where any falsy answer (None aside) fails the refit. Its metrics: none."""
        spec = self.generation.get_collective_sender_spec()
        sending = self.policy.broadcast_weights_for_collective(
            kv_scales=kv_scales, buffer_size_bytes=spec.buffer_size_bytes,
            num_buffers=spec.num_buffers)
        receiving = self.generation.update_weights_from_collective()
        ray.get(sending)
        answers = ray.get(receiving)
        if not all(answer for answer in answers if answer is not None):
            raise RuntimeError(f"the collective refit failed on the backend: {answers}")
        self.is_stale = False
        return {}
