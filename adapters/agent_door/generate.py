"""vLLM's token-in/token-out face of the door (``POST /inference/v1/generate``), in vLLM's own
request and answer shapes, served as a rollout (``core.wire.completion_body``): the worker
answers every generated ID with its logprob in ``engine_data``, as the driver's rollouts are.

The request, as vLLM reads it: ``token_ids`` (the prompt, non-empty, each ID >= 0),
``sampling_params`` (vLLM's SamplingParams fields: ``n``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``max_tokens`` (default: what the context leaves), ``stop``,
``stop_token_ids``, ``ignore_eos``, ``logprobs``; fields that only shape text, e.g.
``detokenize``, mean nothing here), and optionally ``request_id``, ``model``, ``stream``,
``stream_options.include_usage``, ``return_token_ids`` (the prompt's IDs in the answer) and
``output_mode`` (``"tokens"``: the only mode served). A field the rollout cannot honour at a
value that asks for something (a penalty, ``logprobs`` > 0: alternatives per token, a grammar)
is refused by name.

The answer: ``request_id``, ``model``, ``created``, ``output_mode: "tokens"``, ``usage``,
``prompt_token_ids`` (when asked) and one choice per sample, each with its ``index``,
``token_ids``, ``finish_reason`` (``stop``, ``length``, ``abort``), ``stop_reason`` (null),
``logprobs`` (``{"content": [{"token_id", "logprob", "rank", "top_logprobs": []}, ...]}``, or
null when none were asked for) and ``weight_versions`` (spans ``{"version", "start",
"end"}`` over the generated tokens). Streamed, the same choices come as server-sent events, one
per choice once it is whole (the prompt's IDs on the first), then the usage when asked, then
``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.adapters.agent_door.prompts import check_context, check_vocabulary
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec, ServedRollout
from rollout_fleet.core.validate import is_finite_number, is_int

SESSION_HEADER = "X-Session-ID"  # vLLM's: a session's requests go to one worker
_TOP_FIELDS = frozenset({"request_id", "token_ids", "sampling_params", "model", "stream",
                         "stream_options", "return_token_ids", "output_mode", "priority"})
_SAMPLING_FIELDS = frozenset({"n", "temperature", "top_p", "top_k", "seed", "max_tokens",
                              "stop", "stop_token_ids", "ignore_eos", "logprobs"})
# Fields that shape only the text of an answer (there is none here): any value is served.
_TEXT_ONLY = frozenset({"detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                        "include_stop_str_in_output", "output_kind"})
# Fields served at the value that asks for nothing (or at a neutral one).
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
            "repetition_penalty": (1, 1.0), "min_p": (0, 0.0), "min_tokens": (0,),
            "best_of": (1,), "length_penalty": (1, 1.0)}


def generate_request(body: Mapping[str, Any], *, model: str, max_model_len: int,
                     vocab_size: int) -> RolloutRequest:
    """The rollout a ``/inference/v1/generate`` body asks for; InvalidValue names what it
    cannot be."""
    _refuse_unserved(body, _TOP_FIELDS, "", {"priority": (0,)})
    if body.get("output_mode", "tokens") != "tokens":
        raise InvalidValue("output_mode", body["output_mode"], "only 'tokens' is served here "
                           "(text: the door's /v1/completions)")
    if body.get("model") not in (None, model):
        raise InvalidValue("model", body["model"], f"this fleet serves {model!r}")
    prompt = body.get("token_ids")
    if not isinstance(prompt, list) or not prompt or not all(is_int(t) for t in prompt):
        raise InvalidValue("token_ids", prompt, "must be a non-empty list of token IDs")
    check_vocabulary("token_ids", prompt, vocab_size)
    params = body.get("sampling_params")
    if not isinstance(params, Mapping):
        raise InvalidValue("sampling_params", params, "must be an object (vLLM's "
                                                     "SamplingParams fields)")
    _refuse_unserved(params, _SAMPLING_FIELDS | _TEXT_ONLY, "sampling_params.", _NEUTRAL)
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise InvalidValue("sampling_params.max_tokens", max_tokens, "must be an int >= 1")
    check_context("token_ids", len(prompt), ("sampling_params.max_tokens", max_tokens),
                  max_model_len)
    stop_token_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(is_int(t) for t in stop_token_ids):
        raise InvalidValue("sampling_params.stop_token_ids", stop_token_ids,
                           "must be a list of token IDs")
    check_vocabulary("sampling_params.stop_token_ids", stop_token_ids, vocab_size)
    try:
        return RolloutRequest(
            _request_id(body.get("request_id")), prompt,
            max_model_len - len(prompt) if max_tokens is None else max_tokens,
            sampling=_sampling(params), stop_strings=_stop_strings(params.get("stop")),
            stop_token_ids=stop_token_ids, n=params.get("n") or 1,
            ignore_eos=bool(params.get("ignore_eos")), logprobs=_logprobs(params))
    except InvalidValue as exc:
        raise InvalidValue(f"sampling_params.{exc.field}", exc.value, exc.rule) from None


def _refuse_unserved(fields: Mapping[str, Any], served: frozenset[str], prefix: str,
                     neutral: Mapping[str, tuple[Any, ...]]) -> None:
    for name, value in fields.items():
        if name in served or value in (None, False, [], {}) or value in neutral.get(name, ()):
            continue
        rule = (f"is served only at {neutral[name][0]!r} here" if name in neutral else
                "is not served here (a rollout carries no such field)")
        raise InvalidValue(f"{prefix}{name}", value, rule)


def _request_id(asked: Any) -> str:
    if asked is None:
        return f"door-generate-{uuid.uuid4().hex}"
    if not isinstance(asked, str) or not asked:
        raise InvalidValue("request_id", asked, "must be a non-empty string")
    return asked


def _sampling(params: Mapping[str, Any]) -> SamplingSpec:
    temperature = params.get("temperature", 1.0)
    if not is_finite_number(temperature) or temperature < 0:
        raise InvalidValue("temperature", temperature, "must be a finite number >= 0")
    top_k = params.get("top_k")
    return SamplingSpec(greedy=temperature == 0, temperature=temperature or 1.0,
                        top_p=params.get("top_p", 1.0),
                        top_k=-1 if top_k in (None, 0, -1) else top_k, seed=params.get("seed"))


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _logprobs(params: Mapping[str, Any]) -> bool:
    asked = params.get("logprobs")
    if asked is None:
        return False
    if asked != 0 or isinstance(asked, bool):
        raise InvalidValue("logprobs", asked, "0 (each sampled token's logprob) or null: "
                                              "alternatives per token are not served")
    return True


def generate_answer(request: RolloutRequest, samples: Sequence[ServedRollout], *, model: str,
                    return_token_ids: bool) -> dict[str, Any]:
    """vLLM's whole answer (``output_mode: "tokens"``) to ``request``."""
    generated = sum(len(served.token_ids) for served in samples)
    prompt_len = len(request.prompt_token_ids)
    return {"request_id": request.request_id, "model": model, "created": int(time.time()),
            "output_mode": "tokens",
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": generated,
                      "total_tokens": prompt_len + generated},
            "prompt_token_ids": list(request.prompt_token_ids) if return_token_ids else None,
            "choices": [_choice(index, served) for index, served in enumerate(samples)]}


def _choice(index: int, served: ServedRollout) -> dict[str, Any]:
    logprobs: dict[str, Any] | None = None if served.logprobs is None else {"content": [
        {"token_id": token, "logprob": logprob, "rank": None, "top_logprobs": []}
        for token, logprob in zip(served.token_ids, served.logprobs)]}
    return {"index": index, "finish_reason": served.finish_reason.value, "stop_reason": None,
            "token_ids": list(served.token_ids), "logprobs": logprobs,
            "routed_experts": served.routed_experts if isinstance(served.routed_experts, str)
            else None,
            "weight_versions": _spans(served)}


def _spans(served: ServedRollout) -> list[dict[str, Any]] | None:
    """The run-length weight versions as vLLM's spans over output-token indexes."""
    if not served.weight_versions:
        return None
    spans, start = [], 0
    for version, count in served.weight_versions:
        spans.append({"version": str(version), "start": start, "end": start + count})
        start += count
    return spans


def generate_events(answer: Mapping[str, Any], *, include_usage: bool) -> bytes:
    """A whole answer as vLLM's streamed one: a chunk per choice, the prompt's IDs (when
    asked) on the first, the usage when asked, ``[DONE]``."""
    chunks: list[dict[str, Any]] = []
    for choice in answer["choices"]:
        chunk: dict[str, Any] = {"request_id": answer["request_id"], "output_mode": "tokens",
                                 "choices": [choice]}
        if not chunks and answer.get("prompt_token_ids") is not None:
            chunk["prompt_token_ids"] = answer["prompt_token_ids"]
        chunks.append(chunk)
    if include_usage:
        chunks.append({"request_id": answer["request_id"], "output_mode": "tokens",
                       "choices": [], "usage": answer["usage"]})
    lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()
