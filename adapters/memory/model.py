"""The memory engine's model: a factored bigram table over a 48-token vocabulary (next-token
logits ``embed[prev] . lm_head[next]``), built from a seed; its decoding (greedy or seeded
sampling, steered by logit bias and allowed tokens) and its weights as refit tensors."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from rollout_fleet.core.errors import EngineRejected, InvalidValue, RefitError, WeightMismatch
from rollout_fleet.core.refit import TensorMeta, dtype_name
from rollout_fleet.core.rollout import SamplingSpec

EOS_TOKEN_ID = 0


_SYLLABLES = ("th", "er", "on", "an", "re", "he", "in", "ed", "nd", "ha",
              "at", "en", "es", "of", "or", "nt", "ea", "ti", "to")


VOCAB: tuple[str, ...] = ("<eos>",) + tuple("abcdefghijklmnopqrstuvwxyz") + (" ", ".") + _SYLLABLES


HIDDEN = 8


WEIGHT_NAMES = ("embed.weight", "lm_head.weight")


BALLAST_PREFIX = "ballast."
BALLAST_PIECE_BYTES = 16 << 20


def ballast_metas(nbytes: int) -> dict[str, TensorMeta]:
    """Weights of ``nbytes`` besides the model's own (byte tensors of at most 16 MiB each) that a
    refit may carry and the engine drops as they arrive: a refit of a real model's size to a
    fleet of memory engines, each holding no more than its receive buffers meanwhile."""
    sizes = [min(BALLAST_PIECE_BYTES, nbytes - start)
             for start in range(0, nbytes, BALLAST_PIECE_BYTES)]
    return {f"{BALLAST_PREFIX}{index}": TensorMeta(f"{BALLAST_PREFIX}{index}", (size,), "uint8")
            for index, size in enumerate(sizes)}


def _random_matrix(rng: random.Random, rows: int, cols: int) -> list[list[float]]:
    return [[rng.gauss(0.0, 1.0) for _ in range(cols)] for _ in range(rows)]


class TinyBigramModel:
    """Weights and the math of the tiny model; no state about requests."""

    def __init__(self, embed: list[list[float]], lm_head: list[list[float]]) -> None:
        # None once a level-2 sleep dropped them, until a refit loads new ones
        self.embed: list[list[float]] | None = embed
        self.lm_head: list[list[float]] | None = lm_head
        self._logprob_rows: dict[int, list[float]] = {}  # the "prefix cache": prev token -> row

    @classmethod
    def from_seed(cls, seed: int) -> "TinyBigramModel":
        rng = random.Random(seed)
        embed = _random_matrix(rng, len(VOCAB), HIDDEN)
        lm_head = _random_matrix(rng, len(VOCAB), HIDDEN)
        lm_head[EOS_TOKEN_ID] = [0.5 * w for w in lm_head[EOS_TOKEN_ID]]  # keep EOS uncommon
        return cls(embed, lm_head)

    @property
    def holds_weights(self) -> bool:
        return self.embed is not None and self.lm_head is not None

    def forget_weights(self) -> None:
        """What a level-2 sleep does: the weights are gone until a refit loads new ones."""
        self.embed = self.lm_head = None
        self.clear_cache()

    def _weights(self) -> tuple[list[list[float]], list[list[float]]]:
        if self.embed is None or self.lm_head is None:
            raise RefitError("the weights were dropped by a level-2 sleep: a refit loads them")
        return self.embed, self.lm_head

    def state_dict(self) -> dict[str, list[list[float]]]:
        embed, lm_head = self._weights()
        return {"embed.weight": [row[:] for row in embed],
                "lm_head.weight": [row[:] for row in lm_head]}

    def logprobs_after(self, prev: int) -> list[float]:
        row = self._logprob_rows.get(prev)
        if row is None:
            embed, lm_head = self._weights()
            logits = [sum(a * b for a, b in zip(embed[prev], u)) for u in lm_head]
            top = max(logits)
            log_z = top + math.log(sum(math.exp(x - top) for x in logits))
            row = [x - log_z for x in logits]
            self._logprob_rows[prev] = row
        return row

    def clear_cache(self) -> None:
        self._logprob_rows.clear()


def decode(token_ids: Iterable[int]) -> str:
    """Text of generated tokens; EOS renders as nothing."""
    return "".join(VOCAB[t] for t in token_ids if t != EOS_TOKEN_ID)


def pick_token(logprobs: list[float], sampling: SamplingSpec, rng: random.Random) -> int:
    if sampling.greedy:
        return max(range(len(logprobs)), key=logprobs.__getitem__)
    scaled = [lp / sampling.temperature for lp in logprobs]
    order = sorted(range(len(scaled)), key=scaled.__getitem__, reverse=True)
    if sampling.top_k != -1:
        order = order[: sampling.top_k]
    top = scaled[order[0]]
    weights = [math.exp(scaled[i] - top) for i in order]
    total = sum(weights)
    kept, kept_weights, mass = [], [], 0.0
    for token, weight in zip(order, weights):
        kept.append(token)
        kept_weights.append(weight)
        mass += weight / total
        if mass >= sampling.top_p:
            break
    return rng.choices(kept, weights=kept_weights)[0]


def as_matrix(name: str, tensor: Any, expected: TensorMeta) -> list[list[float]]:
    dtype = getattr(tensor, "dtype", None)
    if dtype is not None:
        try:
            got = dtype_name(dtype)
        except InvalidValue:
            got = str(dtype)
        if got != expected.dtype:
            raise WeightMismatch(f"dtype of {name!r}", got, f"the engine's parameter is {expected.dtype}")
    rows = tensor.tolist() if hasattr(tensor, "tolist") else tensor
    shape_ok = (isinstance(rows, list) and len(rows) == expected.shape[0]
                and all(isinstance(r, list) and len(r) == expected.shape[1] for r in rows))
    if not shape_ok:
        raise WeightMismatch(f"shape of {name!r}", _shape_of(rows),
                             f"the engine's parameter has shape {list(expected.shape)}")
    try:
        out = [[float(x) for x in row] for row in rows]
    except (TypeError, ValueError):
        raise WeightMismatch(f"values of {name!r}", "non-numeric", "must be floats") from None
    if not all(math.isfinite(x) for row in out for x in row):
        raise WeightMismatch(f"values of {name!r}", "non-finite", "must be finite floats")
    return out


def _shape_of(value: Any) -> list[int]:
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        value = value[0] if value else None
    return shape


@attrs.frozen
class Steering:
    """What the offered sampling options change: which tokens may be picked at a step (the
    logprobs reported stay the model's own, as vLLM's raw logprobs do) and where it stops."""

    OFFERED = frozenset({"ignore_eos", "min_tokens", "allowed_token_ids"})

    stop_ids: frozenset[int]
    min_tokens: int = 0
    allowed: frozenset[int] | None = None

    @classmethod
    def of(cls, extra: Mapping[str, Any], stop_token_ids: Sequence[int]) -> "Steering":
        unknown = sorted(set(extra) - cls.OFFERED)
        if unknown:
            raise EngineRejected(f"{unknown[0]}={extra[unknown[0]]!r}: not offered by the memory engine")
        stop_ids = frozenset(stop_token_ids) | (set() if extra.get("ignore_eos") else {EOS_TOKEN_ID})
        allowed = extra.get("allowed_token_ids")
        return cls(frozenset(stop_ids), extra.get("min_tokens", 0),
                   None if allowed is None else frozenset(allowed))

    def steered(self, row: list[float], step: int) -> list[float]:
        if self.allowed is None and step >= self.min_tokens:
            return row
        banned = self.stop_ids if step < self.min_tokens else ()
        return [lp if (self.allowed is None or t in self.allowed) and t not in banned
                else -math.inf for t, lp in enumerate(row)]
