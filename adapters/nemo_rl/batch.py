"""Batches at the driver's edge: torch tensors in, torch tensors out, NeMo-RL's layout."""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from rollout_fleet.core.errors import InvalidValue, WireError
from rollout_fleet.core.rollout import (
    MAX_GROUP_SIZE, RolloutRequest, RolloutResult, SamplingSpec, sample_sampling,
)

OUTPUT_KEYS = ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths",
               "truncated", "weight_versions")
NO_VERSION = -1  # weight_versions at prompt and padding positions (and where untagged)


@attrs.frozen
class PromptBatch:
    prompts: tuple[list[int], ...]
    stop_strings: tuple[Sequence[str] | None, ...]


def read_batch(data: Any) -> PromptBatch:
    """``input_ids`` [B, S] right-padded, ``input_lengths`` [B], optional ``stop_strings``."""
    if not isinstance(data, Mapping) and not hasattr(data, "keys"):
        raise InvalidValue("data", type(data).__name__, "must be a mapping of tensors "
                           "(a dict or NeMo-RL's BatchedDataDict)")
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise InvalidValue("data", sorted(data.keys()), f"has no {key!r}")
    input_ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise InvalidValue("input_ids", _describe(input_ids), "must be an integer tensor [B, S]")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 \
            or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise InvalidValue("input_lengths", _describe(lengths), "must be an integer tensor [B]")
    batch_size = input_ids.shape[0]
    if batch_size < 1:
        raise InvalidValue("input_ids", _describe(input_ids), "must hold at least one prompt")
    if lengths.shape[0] != batch_size:
        raise InvalidValue("input_lengths", _describe(lengths),
                           f"must have one length per prompt ({batch_size})")
    check_prompts(input_ids, lengths)
    rows, lens = input_ids.tolist(), lengths.tolist()
    stops = data.get("stop_strings") if hasattr(data, "get") else None
    if stops is None:
        stops = (None,) * batch_size
    elif isinstance(stops, str) or not isinstance(stops, Sequence) or len(stops) != batch_size:
        raise InvalidValue("stop_strings", stops, f"must be one list (or None) per prompt ({batch_size})")
    return PromptBatch(tuple(row[:n] for row, n in zip(rows, lens)), tuple(stops))


def check_prompts(input_ids: torch.Tensor, lengths: torch.Tensor) -> None:
    """Every length in [1, S] and every prompt token ID >= 0 (padding is never read), checked
    once for the whole batch by tensor ops; the first culprit is named with its value."""
    width = input_ids.shape[1]
    out_of_range = (lengths < 1) | (lengths > width)
    if out_of_range.any():
        index = int(out_of_range.nonzero()[0, 0])
        raise InvalidValue(f"input_lengths[{index}]", lengths[index].item(), f"must be in [1, {width}]")
    positions = torch.arange(width, device=input_ids.device)
    negative = (input_ids < 0) & (positions < lengths.to(input_ids.device).unsqueeze(1))
    if negative.any():
        row, column = negative.nonzero()[0].tolist()
        raise InvalidValue(f"input_ids[{row}, {column}]", input_ids[row, column].item(),
                           "token IDs are non-negative ints")


def sample_output(prompt: list[int], result: RolloutResult) -> dict[str, torch.Tensor]:
    """One sample in the contract's layout: L = prompt + generated, logprobs 0 at the prompt.

    Each tensor is a view of a typed array filled by C loops (``torch.frombuffer``), not
    ``torch.tensor(list)``, which infers a type per element, nor ``torch.full``: this runs once
    per rollout on the driver's hot path, where each torch call costs about a microsecond.
    """
    generated = result.token_ids
    prompt_len = len(prompt)
    total = prompt_len + len(generated)
    ids = array.array("q", prompt)
    ids.extend(generated)
    if result.logprobs is None:  # the contract's rollouts always ask for them
        raise WireError("a rollout came back without its logprobs, which the contract carries")
    logprobs = array.array("f", bytes(4 * prompt_len))
    logprobs.extend(result.logprobs)
    return {
        "output_ids": torch.frombuffer(ids, dtype=torch.long).view(1, total),
        "logprobs": torch.frombuffer(logprobs, dtype=torch.float32).view(1, total),
        "generation_lengths": torch.frombuffer(array.array("q", (len(generated),)), dtype=torch.long),
        "unpadded_sequence_lengths": torch.frombuffer(array.array("q", (total,)), dtype=torch.long),
        "truncated": torch.frombuffer(bytearray((result.truncated,)), dtype=torch.bool),
        # The weight version that sampled each generated token, aligned with output_ids (a
        # trainer masks or weights off-policy tokens by it); NO_VERSION elsewhere.
        "weight_versions": torch.frombuffer(token_versions(prompt_len, result),
                                            dtype=torch.long).view(1, total),
    }


def token_versions(prompt_len: int, result: RolloutResult) -> array.array:
    """The weight version of each position: NO_VERSION over the prompt (and every generated
    token when the answer carries no versions), then the run-length tags expanded."""
    versions = array.array("q", (NO_VERSION,)) * prompt_len
    if not result.weight_versions:
        return versions + array.array("q", (NO_VERSION,)) * len(result.token_ids)
    for version, count in result.weight_versions:  # usually one run
        versions.extend(array.array("q", (version,)) * count)
    return versions


def like(data: Any, out: dict[str, Any]) -> Any:
    """``out`` in the caller's batch type (a dict subclass such as BatchedDataDict), else a dict."""
    kind = type(data)
    if kind is dict or not isinstance(data, (dict, Mapping)):
        return out
    try:
        return kind(out)
    except Exception:  # a mapping type that cannot be built from a dict: hand back a dict
        return out


def stack_outputs(samples: Sequence[Mapping[str, torch.Tensor]], pad_token_id: int
                  ) -> dict[str, torch.Tensor]:
    """Per-sample outputs (in sample order) as one right-padded batch [B, max L]."""
    if not samples:
        raise InvalidValue("samples", [], "need at least one sample")
    width = max(s["output_ids"].shape[1] for s in samples)
    output_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    versions = torch.full((len(samples), width), NO_VERSION, dtype=torch.long)
    for row, s in enumerate(samples):
        n = s["output_ids"].shape[1]
        output_ids[row, :n] = s["output_ids"][0]
        logprobs[row, :n] = s["logprobs"][0]
        if "weight_versions" in s:
            versions[row, :n] = s["weight_versions"][0]
    return {
        "output_ids": output_ids, "logprobs": logprobs, "weight_versions": versions,
        **{key: torch.cat([s[key] for s in samples]) for key in
           ("generation_lengths", "unpadded_sequence_lengths", "truncated")},
    }


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def seeded_for(sampling: SamplingSpec, number: int) -> SamplingSpec:
    """A base seed gives each rollout its own seed (base + its number): the samples of one prompt
    differ, and a run that asks the same things in the same order draws the same tokens."""
    if sampling.greedy or sampling.seed is None:
        return sampling
    return attrs.evolve(sampling, seed=(sampling.seed + number) % 2**63)


def grouped(requests: Sequence[RolloutRequest]) -> list[tuple[int, RolloutRequest]]:
    """(first sample's index, request) per group: NeMo-RL repeats a GRPO group's prompt, and
    consecutive requests of one prompt, budget and stops whose sampling is the first's
    ``sample_sampling(i)`` (as ``seeded_for`` numbers them, or greedy) become one request of n
    samples, served by one worker from one prefill; any other request stays alone."""
    units: list[tuple[int, RolloutRequest]] = []
    for index, request in enumerate(requests):
        if units and _next_of_group(units[-1][1], request):
            first, group = units[-1]
            units[-1] = (first, attrs.evolve(group, n=group.n + 1))
        else:
            units.append((index, request))
    return units


def _next_of_group(group: RolloutRequest, request: RolloutRequest) -> bool:
    return (group.n < MAX_GROUP_SIZE and request.prompt_token_ids == group.prompt_token_ids
            and request.max_new_tokens == group.max_new_tokens
            and request.stop_strings == group.stop_strings
            and request.stop_token_ids == group.stop_token_ids
            and request.sampling == sample_sampling(group.sampling, group.n))
