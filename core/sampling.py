"""Sampling options beyond ``SamplingSpec`` that an engine may honour (vLLM's), checked here.

Each has a neutral value, the one that changes nothing: a request carrying only neutral values
is served by any engine (OpenAI clients such as vLLM's benchmark send them unasked). A
non-neutral value reaches the engine only if the engine declares the option
(``EnginePort.sampling_offered``); otherwise it is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import check_bool, check_int_at_least, is_finite_number, is_int

# name -> neutral value. None is neutral for every option (not asked).
NEUTRAL_SAMPLING: Mapping[str, Any] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "allowed_token_ids": None,
    "logit_bias": None,
    # Constrained decoding: the output follows a JSON schema, a regex, one of a list of
    # choices or a grammar. Dynamo's frontend asks it (as ``guided_decoding``) for a
    # ``tool_choice`` that names a function or is "required", so a call always parses.
    "structured_outputs": None,
}
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar")


def extra_sampling(values: Mapping[str, Any]) -> dict[str, Any]:
    """The non-neutral options of ``values`` (names of ``NEUTRAL_SAMPLING``), each checked and
    normalised; InvalidValue names the first bad one. Unknown names are the caller's to refuse."""
    asked: dict[str, Any] = {}
    for name, value in values.items():
        if value is None or name not in NEUTRAL_SAMPLING:
            continue
        value = _CHECKS[name](name, value)
        if value != NEUTRAL_SAMPLING[name] and value not in ({}, []):
            asked[name] = value
    return asked


def _penalty_above_zero(name: str, value: Any) -> float:
    if not is_finite_number(value) or value <= 0:
        raise InvalidValue(name, value, "must be a finite float > 0 (1.0: off)")
    return float(value)


def _penalty_in_two(name: str, value: Any) -> float:
    if not is_finite_number(value) or not -2.0 <= value <= 2.0:
        raise InvalidValue(name, value, "must be a float in [-2, 2] (0: off)")
    return float(value)


def _fraction(name: str, value: Any) -> float:
    if not is_finite_number(value) or not 0.0 <= value <= 1.0:
        raise InvalidValue(name, value, "must be a float in [0, 1] (0: off)")
    return float(value)


def _count(name: str, value: Any) -> int:
    return check_int_at_least(name, value, 0)


def _flag(name: str, value: Any) -> bool:
    return check_bool(name, value)


def _token_list(name: str, value: Any) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise InvalidValue(name, value, "must be a list of token IDs")
    for index, token in enumerate(value):
        check_int_at_least(f"{name}[{index}]", token, 0, "token IDs are non-negative ints")
    return list(value)


def _bias_map(name: str, value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise InvalidValue(name, value, "must map token IDs to biases")
    biases = {}
    for token, bias in value.items():
        token_id = int(token) if isinstance(token, str) and token.isdigit() else token
        if not is_int(token_id) or token_id < 0:
            raise InvalidValue(f"{name} key", token, "must be a token ID (an int >= 0)")
        if not is_finite_number(bias) or not -100.0 <= bias <= 100.0:
            raise InvalidValue(f"{name}[{token}]", bias, "must be a float in [-100, 100]")
        biases[token_id] = float(bias)
    return biases


def _structured(name: str, value: Any) -> dict[str, Any]:
    """Exactly one constraint (``json``: a schema, ``regex``, ``choice``: a list of strings,
    ``grammar``); ``whitespace_pattern`` may ride along. Other keys (a backend's name) are
    dropped: the engine picks its own backend."""
    if not isinstance(value, Mapping):
        raise InvalidValue(name, value,
                           f"must be a table with one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")
    asked = {kind: value[kind] for kind in STRUCTURED_OUTPUT_KINDS if value.get(kind) is not None}
    if len(asked) != 1:
        raise InvalidValue(name, value, "must ask for exactly one of "
                           f"{', '.join(STRUCTURED_OUTPUT_KINDS)}")
    kind, constraint = next(iter(asked.items()))
    if kind == "json" and not isinstance(constraint, (Mapping, str)):
        raise InvalidValue(f"{name}.json", constraint,
                           "must be a JSON schema (an object or its text)")
    if kind == "choice" and (not isinstance(constraint, (list, tuple)) or not constraint
                             or not all(isinstance(c, str) for c in constraint)):
        raise InvalidValue(f"{name}.choice", constraint, "must be a non-empty list of strings")
    if kind in ("regex", "grammar") and (not isinstance(constraint, str) or not constraint):
        raise InvalidValue(f"{name}.{kind}", constraint, "must be a non-empty string")
    if isinstance(value.get("whitespace_pattern"), str):
        asked["whitespace_pattern"] = value["whitespace_pattern"]
    return asked


_CHECKS = {
    "repetition_penalty": _penalty_above_zero,
    "presence_penalty": _penalty_in_two,
    "frequency_penalty": _penalty_in_two,
    "min_p": _fraction,
    "min_tokens": _count,
    "ignore_eos": _flag,
    "allowed_token_ids": _token_list,
    "logit_bias": _bias_map,
    "structured_outputs": _structured,
}
