"""Rollout values: what a trainer asks for and what the fleet answers."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import (
    check_bool, check_int_at_least, check_int_in, int_at_least, is_finite_number, is_int, is_real,
)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # the token budget ran out
    ABORT = "abort"  # cancelled (client gone, fleet shutting down)

    @classmethod
    def parse(cls, value: Any, field: str = "finish_reason") -> "FinishReason":
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(r.value for r in cls)
            raise InvalidValue(field, value, f"must be one of {allowed}") from None


_PLAIN_SEQUENCES = (list, tuple)
_INT_ONLY = frozenset({int})
_FLOAT_ONLY = frozenset({float})


def as_token_ids(value: Any, field: str) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints (bools refused); InvalidValue naming ``field``
    (and the element) otherwise."""
    # Fast path (the driver's hot path): a list/tuple of plain non-negative ints, checked
    # in C loops; anything else takes the element-by-element path that names the culprit.
    if type(value) in _PLAIN_SEQUENCES and (
            not value or (set(map(type, value)) <= _INT_ONLY and min(value) >= 0)):
        return tuple(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        try:
            value = list(value)
        except TypeError:
            raise InvalidValue(field, value, "must be a sequence of token IDs") from None
    for index, token in enumerate(value):
        check_int_at_least(f"{field}[{index}]", token, 0, "token IDs are non-negative ints")
    return tuple(value)


def as_logprobs(value: Any, field: str) -> tuple[float, ...]:
    """``value`` as a tuple of finite floats <= 0."""
    if type(value) in _PLAIN_SEQUENCES and (not value or (
            set(map(type, value)) <= _FLOAT_ONLY and max(value) <= 0.0
            and all(map(math.isfinite, value)))):
        return tuple(value)  # fast path, as for token IDs
    try:
        items = list(value)
    except TypeError:
        raise InvalidValue(field, value, "must be a sequence of floats") from None
    out = []
    for index, lp in enumerate(items):
        if not is_real(lp):
            raise InvalidValue(f"{field}[{index}]", lp, "logprobs are floats")
        if not is_finite_number(lp) or lp > 0.0:
            raise InvalidValue(f"{field}[{index}]", lp, "logprobs are finite and <= 0")
        out.append(float(lp))
    return tuple(out)


VersionRuns = tuple[tuple[int, int], ...]


def as_version_runs(value: Any, field: str) -> VersionRuns:
    """``value`` as run-length weight versions ``((version, n_tokens), ...)``.

    Each version is an int >= 0 and each count an int >= 1; adjacent runs of one version are
    merged, so two answers that tag the same tokens alike compare equal.
    """
    # Fast path (every answer on the driver's hot path, twice): none or one run of plain ints.
    if type(value) in _PLAIN_SEQUENCES and len(value) <= 1:
        if not value:
            return ()
        run = value[0]
        if type(run) in _PLAIN_SEQUENCES and len(run) == 2 and type(run[0]) is int \
                and type(run[1]) is int and run[0] >= 0 and run[1] >= 1:
            return ((run[0], run[1]),)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidValue(field, value, "must be a list of [version, n_tokens] pairs")
    runs: list[tuple[int, int]] = []
    for index, run in enumerate(value):
        if isinstance(run, (str, bytes)) or not isinstance(run, Sequence) or len(run) != 2:
            raise InvalidValue(f"{field}[{index}]", run, "must be a [version, n_tokens] pair")
        version, count = run
        check_int_at_least(f"{field}[{index}][0]", version, 0, "a weight version is an int >= 0")
        check_int_at_least(f"{field}[{index}][1]", count, 1, "a token count is an int >= 1")
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + count)
        else:
            runs.append((version, count))
    return tuple(runs)


def token_ids_tuple(field: str) -> Callable[[Any], tuple[int, ...]]:
    """A converter: ``as_token_ids`` naming ``field``."""
    return lambda value: as_token_ids(value, field)


def logprobs_tuple(field: str) -> Callable[[Any], tuple[float, ...]]:
    """A converter: ``as_logprobs`` naming ``field``."""
    return lambda value: as_logprobs(value, field)


def version_runs(field: str) -> Callable[[Any], VersionRuns]:
    """A converter: ``as_version_runs`` naming ``field``."""
    return lambda value: as_version_runs(value, field)


# The attrs fields' converters, one named function each (a type checker reads their types).
def _token_ids(value: Any) -> tuple[int, ...]:
    return as_token_ids(value, "token_ids")


def checked_prompt(value: Any, field: str = "prompt_token_ids") -> tuple[int, ...]:
    """A prompt as it enters, from a caller or the wire: a non-empty tuple of token IDs. Past
    that point it is typed, and nothing checks it again."""
    prompt = as_token_ids(value, field)
    if not prompt:
        raise InvalidValue(field, [], "a prompt needs at least one token")
    return prompt


def as_stop_token_ids(value: Any) -> tuple[int, ...]:
    return as_token_ids(value, "stop_token_ids")


def _optional_logprobs(value: Any) -> tuple[float, ...] | None:
    """None (none were asked for) or the logprobs."""
    return None if value is None else as_logprobs(value, "logprobs")


def weight_version_runs(value: Any) -> VersionRuns:
    return as_version_runs(value, "weight_versions")


def _finish_reason(value: Any) -> FinishReason:
    return FinishReason.parse(value)


def join_version_runs(first: Sequence[tuple[int, int]], second: Sequence[tuple[int, int]]
                      ) -> VersionRuns:
    """The runs of two consecutive pieces of one generation, as one list."""
    return weight_version_runs([*first, *second])


def _whole_rollout_runs(rollout: Any) -> VersionRuns:
    """The default tagging: every token served by ``weight_version`` (when the engine counts)."""
    if rollout.weight_version is None or not rollout.token_ids:
        return ()
    return ((rollout.weight_version, len(rollout.token_ids)),)


def _check_version_runs(token_ids: tuple[int, ...], runs: VersionRuns) -> None:
    tagged = sum(count for _, count in runs)
    if runs and tagged != len(token_ids):
        raise InvalidValue("weight_versions", [list(r) for r in runs],
                           f"must tag every generated token once ({tagged} tagged, "
                           f"{len(token_ids)} generated)")


def as_stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidValue("stop_strings", value, "must be a list of strings")
    for index, stop in enumerate(value):
        if not isinstance(stop, str) or not stop:
            raise InvalidValue(f"stop_strings[{index}]", stop, "must be a non-empty string")
    return tuple(value)


@attrs.frozen
class SamplingSpec:
    """How to pick each token. Greedy ignores the rest."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.greedy, bool):
            raise InvalidValue("greedy", self.greedy, "must be a bool")
        if not is_finite_number(self.temperature) or self.temperature <= 0:
            raise InvalidValue("temperature", self.temperature, "must be a finite float > 0")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidValue("top_p", self.top_p, "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise InvalidValue("top_k", self.top_k, "must be -1 (off) or an int >= 1")
        if self.seed is not None:
            check_int_in("seed", self.seed, 0, 2**63 - 1, "must be None or an int in [0, 2**63)")


GREEDY = SamplingSpec()
# The most samples one request may ask for: a group is served by one worker, in one engine.
MAX_GROUP_SIZE = 1024


def sample_sampling(sampling: SamplingSpec, index: int) -> SamplingSpec:
    """Sample ``index`` of a group: its own seed (the group's seed + index), as vLLM's own
    ``n`` gives each sample and as a driver numbering its rollouts would; greedy or unseeded
    sampling is every sample's."""
    if sampling.greedy or sampling.seed is None or index == 0:
        return sampling
    return attrs.evolve(sampling, seed=sampling.seed + index)


def _check_group(n: Any, sampling: SamplingSpec) -> None:
    check_int_in("n", n, 1, MAX_GROUP_SIZE,
                 f"the samples of one prompt are an int in [1, {MAX_GROUP_SIZE}]")
    seed = sampling.seed
    if n > 1 and not sampling.greedy and seed is not None and seed + n - 1 > 2**63 - 1:
        raise InvalidValue("seed", seed, f"a group of {n} samples takes seeds up to"
                                         f" seed + {n - 1}, which must stay below 2**63")


def check_rollout_fields(request_id: Any, max_new_tokens: Any, sampling: Any, n: Any,
                         ignore_eos: Any, logprobs: Any) -> None:
    """Every field of a rollout but its prompt and stop sequences (their converters check
    those): a request's, and the spec a worker reads from the wire (``core.wire.RolloutSpec``)."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidValue("request_id", request_id, "must be a non-empty string")
    check_int_at_least("max_new_tokens", max_new_tokens, 0)
    check_bool("ignore_eos", ignore_eos)
    check_bool("logprobs", logprobs)
    if not isinstance(sampling, SamplingSpec):
        raise InvalidValue("sampling", sampling, "must be a SamplingSpec")
    if type(n) is not int or n != 1:
        _check_group(n, sampling)


@attrs.frozen
class RolloutRequest:
    """One prompt to complete. ``max_new_tokens`` is the budget already fitted to the context."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=checked_prompt)
    max_new_tokens: int
    sampling: SamplingSpec = GREEDY
    stop_strings: tuple[str, ...] = attrs.field(default=(), converter=as_stop_strings)
    # End at any of these tokens (kept as the last token), as at an end-of-sequence token.
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=as_stop_token_ids)
    # A group: n samples of this prompt in one request (one prefill, one worker); sample i
    # draws with ``sample_sampling(sampling, i)``.
    n: int = 1
    # Generate the whole budget: an end-of-sequence token does not end the rollout (fixed
    # lengths, as benchmarks ask); stop strings and stop_token_ids still do.
    ignore_eos: bool = False
    # The chosen token's logprob per generated token. False for a trainer that recomputes them
    # itself: the engine computes none (they cost vLLM's engine a share of its throughput) and
    # the result's ``logprobs`` is None.
    logprobs: bool = True

    def __attrs_post_init__(self) -> None:
        check_rollout_fields(self.request_id, self.max_new_tokens, self.sampling, self.n,
                             self.ignore_eos, self.logprobs)

    @classmethod
    def from_checked(cls, prompt_token_ids: tuple[int, ...], **fields: Any) -> "RolloutRequest":
        """A request of parts checked where they entered: a prompt (``checked_prompt``) and
        every other field (a worker's ``RolloutSpec``), taken as they are."""
        request = object.__new__(cls)
        object.__setattr__(request, "prompt_token_ids", prompt_token_ids)
        for name, value in fields.items():
            object.__setattr__(request, name, value)
        return request


@attrs.frozen
class Usage:
    prompt_tokens: int = attrs.field(validator=int_at_least("usage.prompt_tokens", 0))
    completion_tokens: int = attrs.field(validator=int_at_least("usage.completion_tokens", 0))


def _check_generation(token_ids: tuple[int, ...], logprobs: tuple[float, ...] | None) -> None:
    if logprobs is not None and len(token_ids) != len(logprobs):
        raise InvalidValue(
            "logprobs", f"{len(logprobs)} values",
            f"need one logprob per generated token ({len(token_ids)} tokens)",
        )


@attrs.frozen
class ServedRollout:
    """An engine's answer to one rollout: generated tokens, one logprob each (None when none
    were asked for), why it ended."""

    token_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    logprobs: tuple[float, ...] | None = attrs.field(converter=_optional_logprobs)
    finish_reason: FinishReason = attrs.field(converter=_finish_reason)
    usage: Usage
    routed_experts: Any = None  # MoE engines: per-token expert choices, passed through as-is
    weight_version: int | None = None  # the weights at completion, when the engine counts them
    # When asked for (``top_logprobs=N``): per generated token, the N most likely tokens at that
    # position as ``(token_id, logprob)`` pairs, most likely first.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # Which weights sampled each token: ((version, n_tokens), ...) in token order; more than one
    # run when a refit swapped the weights while this rollout was in flight.
    weight_versions: VersionRuns = attrs.field(
        default=attrs.Factory(_whole_rollout_runs, takes_self=True),
        converter=weight_version_runs)

    def __attrs_post_init__(self) -> None:
        _check_generation(self.token_ids, self.logprobs)
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.token_ids):
            raise InvalidValue("top_logprobs", f"{len(self.top_logprobs)} positions",
                               f"need one per generated token ({len(self.token_ids)} tokens)")
        if self.weight_version is not None:
            check_int_at_least("weight_version", self.weight_version, 0)
        _check_version_runs(self.token_ids, self.weight_versions)
        if self.usage.completion_tokens != len(self.token_ids):
            raise InvalidValue("usage.completion_tokens", self.usage.completion_tokens,
                               f"must equal the number of generated tokens ({len(self.token_ids)})")

    @classmethod
    def from_decoded(cls, token_ids: tuple[int, ...], logprobs: tuple[float, ...] | None,
                     finish_reason: FinishReason, prompt_tokens: int, *,
                     routed_experts: Any = None, weight_version: int | None = None,
                     weight_versions: Sequence[Sequence[int]] | None = None) -> "ServedRollout":
        """A served rollout from a typed decoder that has checked every element as this class
        would: the token IDs a tuple of ints >= 0, the logprobs a tuple of finite floats <= 0
        or None, the counts ints >= 0 (a weight version may be None). Those per-element checks
        are not run twice on the driver's hot path; the checks across fields (one logprob per
        token, runs that tag every token once) still are, and the runs are merged as usual."""
        served = object.__new__(cls)
        runs = None if weight_versions is None else weight_version_runs(weight_versions)
        for name, value in (("token_ids", token_ids), ("logprobs", logprobs),
                            ("finish_reason", finish_reason),
                            ("usage", Usage(prompt_tokens, len(token_ids))),
                            ("routed_experts", routed_experts), ("weight_version", weight_version),
                            ("top_logprobs", None)):
            object.__setattr__(served, name, value)
        object.__setattr__(served, "weight_versions",
                           _whole_rollout_runs(served) if runs is None else runs)
        _check_generation(token_ids, logprobs)
        _check_version_runs(token_ids, served.weight_versions)
        return served


@attrs.frozen
class RolloutResult:
    """What the trainer gets back for one RolloutRequest (``logprobs`` None when it asked for
    none)."""

    request_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    logprobs: tuple[float, ...] | None = attrs.field(converter=_optional_logprobs)
    finish_reason: FinishReason = attrs.field(converter=_finish_reason)
    routed_experts: Any = None
    weight_version: int | None = None
    attempts: int = 1
    weight_versions: VersionRuns = attrs.field(
        default=attrs.Factory(_whole_rollout_runs, takes_self=True),
        converter=weight_version_runs)

    def __attrs_post_init__(self) -> None:
        _check_generation(self.token_ids, self.logprobs)
        _check_version_runs(self.token_ids, self.weight_versions)

    @property
    def truncated(self) -> bool:
        """True when the budget cut the generation short (NeMo-RL's ``truncated``)."""
        return self.finish_reason is FinishReason.LENGTH

    @classmethod
    def from_served(cls, request_id: str, served: ServedRollout, attempts: int = 1) -> "RolloutResult":
        """The result of one served answer. ``served`` was checked when it was built, so its
        fields are taken as they are (each answer is validated once, not twice: the driver's
        hot path)."""
        check_int_at_least("attempts", attempts, 1)
        result = object.__new__(cls)
        for name, value in (("request_id", request_id), ("token_ids", served.token_ids),
                            ("logprobs", served.logprobs), ("finish_reason", served.finish_reason),
                            ("routed_experts", served.routed_experts),
                            ("weight_version", served.weight_version), ("attempts", attempts),
                            ("weight_versions", served.weight_versions)):
            object.__setattr__(result, name, value)
        return result
