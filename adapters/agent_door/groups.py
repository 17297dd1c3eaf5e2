"""``n > 1`` at the agent door: a GRPO group, n samples of one prompt, served as one rollout
group (one request to one worker, vLLM's own ``n``: one prefill, sample i drawing with the
seed + i) and answered as n OpenAI choices.

Dynamo's frontend ends an answer at its first choice that finishes, so the door sends a group
as the rollout door does (``core.wire.completion_body``: the group travels in the rollout
annotation, the worker answers every sample in ``engine_data``) and writes the choices itself.
What a group cannot honour is refused by name: tools (Dynamo's parsers read one choice),
stop strings and penalties (the rollout door carries none of them). A streamed
group (``stream: true``, as ``vllm bench serve`` asks) is answered once it is whole, as one
event per choice, the usage (when ``stream_options.include_usage``) and ``[DONE]``: its first
event comes when its last sample ends."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec, ServedRollout
from rollout_fleet.core.validate import is_finite_number, is_int

# What a group request may carry besides its prompt (or messages); anything else is refused.
GROUP_FIELDS = frozenset({"model", "prompt", "messages", "n", "max_tokens",
                          "max_completion_tokens", "temperature", "top_p", "seed", "logprobs",
                          "top_logprobs", "return_token_ids", "stream", "stream_options",
                          "user", "chat_template_kwargs", "nvext", "repetition_penalty",
                          "ignore_eos"})
# Fields a group accepts only at the value that asks for nothing.
NEUTRAL = {"repetition_penalty": (1, "a group is sampled without penalties")}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def group_size(body: Mapping[str, Any]) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if not is_int(n) or n < 1:
        raise InvalidValue("n", n, "must be an int >= 1")
    return int(n)


def group_request(body: Mapping[str, Any], prompt: Sequence[int], *,
                  default_max_tokens: int | None, chat: bool) -> RolloutRequest:
    """The rollout group a ``n > 1`` request asks for; refuses, by name, what it cannot serve.
    A completion that asks for no logprobs is sampled without them (as vLLM's server does);
    a chat's samples always carry them (its message's ``generation_log_probs``)."""
    unserved = sorted(set(body) - GROUP_FIELDS)
    if unserved:
        raise InvalidValue(unserved[0], body[unserved[0]],
                           "not served with n > 1 (a group is sampled by the rollout door)")
    for field, (neutral, why) in NEUTRAL.items():
        if field in body and body[field] != neutral:
            raise InvalidValue(field, body[field], f"with n > 1 only {neutral!r}: {why}")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max_tokens))
    if max_tokens is None:
        raise InvalidValue("max_tokens", None, "a chat group (n > 1) needs a token budget")
    temperature = body.get("temperature", 1.0)
    if not is_finite_number(temperature) or temperature < 0:
        raise InvalidValue("temperature", temperature, "must be a finite number >= 0")
    sampling = SamplingSpec(greedy=temperature == 0, temperature=temperature or 1.0,
                            top_p=body.get("top_p", 1.0), seed=body.get("seed"))
    return RolloutRequest(f"door-group-{uuid.uuid4().hex}", tuple(prompt), max_tokens,
                          sampling=sampling, n=group_size(body),
                          ignore_eos=body.get("ignore_eos", False),
                          logprobs=chat or body.get("logprobs") is not None)


def completion_answer(body: Mapping[str, Any], prompt: Sequence[int],
                      samples: Sequence[ServedRollout], decode: Callable[[Sequence[int]], str],
                      token_strings: Callable[[Sequence[int]], list[str]]) -> dict[str, Any]:
    """A ``/v1/completions`` answer of one choice per sample, in sample order."""
    choices = []
    for index, served in enumerate(samples):
        choice: dict[str, Any] = {"index": index, "text": decode(served.token_ids),
                                  "finish_reason": served.finish_reason.value, "logprobs": None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": token_strings(served.token_ids),
                                  "token_logprobs": list(served.logprobs or ()),
                                  "top_logprobs": None}
        if body.get("return_token_ids"):
            choice.update(prompt_token_ids=list(prompt), token_ids=list(served.token_ids))
        choices.append(choice)
    return _answer("text_completion", "cmpl", body, prompt, samples, choices)


def chat_answer(body: Mapping[str, Any], prompt: Sequence[int],
                samples: Sequence[ServedRollout], decode: Callable[[Sequence[int]], str],
                token_strings: Callable[[Sequence[int]], list[str]]) -> dict[str, Any]:
    """A ``/v1/chat/completions`` answer of one choice per sample, each message carrying its
    own tokens (NeMo-Gym's fields) and the weights that served it."""
    choices = []
    for index, served in enumerate(samples):
        message = {"role": "assistant", "content": decode(served.token_ids),
                   "prompt_token_ids": list(prompt),
                   "generation_token_ids": list(served.token_ids),
                   "generation_log_probs": list(served.logprobs or ()),  # always asked
                   "weight_version": served.weight_version,
                   "weight_versions": [list(run) for run in served.weight_versions]}
        choice: dict[str, Any] = {"index": index, "message": message,
                                  "finish_reason": served.finish_reason.value, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": logprob, "bytes": list(token.encode()),
                 "top_logprobs": []}
                for token, logprob in zip(token_strings(served.token_ids), served.logprobs or ())]}
        if body.get("return_token_ids"):
            choice["token_ids"] = list(served.token_ids)
        choices.append(choice)
    answer = _answer("chat.completion", "chatcmpl", body, prompt, samples, choices)
    if body.get("return_token_ids"):
        answer["prompt_token_ids"] = list(prompt)
    return answer


def _answer(kind: str, prefix: str, body: Mapping[str, Any], prompt: Sequence[int],
            samples: Sequence[ServedRollout], choices: list[dict[str, Any]]) -> dict[str, Any]:
    generated = sum(len(served.token_ids) for served in samples)
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": body.get("model"), "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                      "total_tokens": len(prompt) + generated}}


def stream_events(answer: Mapping[str, Any], body: Mapping[str, Any]) -> bytes:
    """A whole group answer as the server-sent events of a streamed one: one chunk per choice
    (a chat choice's message as its delta), then the usage when asked, then ``[DONE]``."""
    chat = answer["object"] == "chat.completion"
    head = {key: answer[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for choice in answer["choices"]:
        if chat:
            choice = {**{k: v for k, v in choice.items() if k != "message"},
                      "delta": choice["message"]}
        events.append({**head, "choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**head, "choices": [], "usage": answer["usage"]})
    lines = [f"data: {json.dumps(event)}\n\n" for event in events] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()
