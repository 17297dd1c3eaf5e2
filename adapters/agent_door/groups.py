"""``n > 1`` at the agent door: a GRPO group, n samples of one prompt, served as one rollout
group (one request to one worker, vLLM's own ``n``: one prefill, sample i drawing with the
seed + i) and answered as n OpenAI choices.

Dynamo's frontend ends an answer at its first choice that finishes, so the door sends a group
as the rollout door does (``core.wire.completion_body``: the group travels in the rollout
annotation, the worker answers every sample in ``engine_data``) and writes the choices itself.
What a group cannot honour is refused by name: tools (Dynamo's parsers read one choice),
streaming, stop strings and penalties (the rollout door carries none of them)."""

from __future__ import annotations

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
                          "top_logprobs", "return_token_ids", "stream", "user",
                          "chat_template_kwargs", "nvext"})
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def group_size(body: Mapping[str, Any]) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if not is_int(n) or n < 1:
        raise InvalidValue("n", n, "must be an int >= 1")
    return int(n)


def group_request(body: Mapping[str, Any], prompt: Sequence[int], *,
                  default_max_tokens: int | None) -> RolloutRequest:
    """The rollout group a ``n > 1`` request asks for; refuses, by name, what it cannot serve."""
    unserved = sorted(set(body) - GROUP_FIELDS)
    if unserved:
        raise InvalidValue(unserved[0], body[unserved[0]],
                           "not served with n > 1 (a group is sampled by the rollout door)")
    if body.get("stream"):
        raise InvalidValue("stream", True, "a group (n > 1) is answered whole: stream false")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max_tokens))
    if max_tokens is None:
        raise InvalidValue("max_tokens", None, "a chat group (n > 1) needs a token budget")
    temperature = body.get("temperature", 1.0)
    if not is_finite_number(temperature) or temperature < 0:
        raise InvalidValue("temperature", temperature, "must be a finite number >= 0")
    sampling = SamplingSpec(greedy=temperature == 0, temperature=temperature or 1.0,
                            top_p=body.get("top_p", 1.0), seed=body.get("seed"))
    return RolloutRequest(f"door-group-{uuid.uuid4().hex}", tuple(prompt), max_tokens,
                          sampling=sampling, n=group_size(body))


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
                                  "token_logprobs": list(served.logprobs), "top_logprobs": None}
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
                   "generation_log_probs": list(served.logprobs),
                   "weight_version": served.weight_version}
        choice: dict[str, Any] = {"index": index, "message": message,
                                  "finish_reason": served.finish_reason.value, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": logprob, "bytes": list(token.encode()),
                 "top_logprobs": []}
                for token, logprob in zip(token_strings(served.token_ids), served.logprobs)]}
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
