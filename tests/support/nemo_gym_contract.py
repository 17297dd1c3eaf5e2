"""NeMo-Gym's policy-model client, restated from its source (the ``vllm_model`` responses-API
server, ``responses_api_models/vllm_model/app.py``, and its HTTP client in
``nemo_gym/openai_utils.py``): what it sends to an OpenAI-compatible policy server during a
training rollout, and how it reads each turn's tokens back. NeMo-Gym is not installed here;
this is the contract in the project's own words, for tests against the agent door.

What it sends (``return_token_id_information: true``): the chat body with ``logprobs: true``,
``top_logprobs: 0`` and ``return_tokens_as_token_ids: true``, and ``return_token_ids: true``
when it is configured to ask for prompt and generation IDs inline; ``n`` must be 1. Earlier
assistant messages go back carrying the three token fields it attached to them when they were
answered.

How it reads a turn's tokens, from the first source present:
1. the answer message's own ``prompt_token_ids`` / ``generation_token_ids`` /
   ``generation_log_probs`` (all three or none); where the answer also has the top-level
   ``prompt_token_ids`` and the choice's ``token_ids``, both must equal the message's;
2. else the generated IDs and their logprobs from ``choice.logprobs.content`` (each entry's
   ``token`` spelled ``token_id:<int>``, its ``logprob`` a number), and the prompt IDs from the
   top-level ``prompt_token_ids`` (the choice's ``token_ids`` then equal to the generated IDs)
   or, without them, from ``POST <base without /v1>/tokenize`` with the request's prompt
   fields (``model``, ``messages``, ``tools``, ``chat_template_kwargs``,
   ``required_prefix_token_ids``).
Either way there is one logprob per generated ID.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
TOKENIZE_FIELDS = ("model", "messages", "tools", "chat_template_kwargs", "mm_processor_kwargs",
                   "required_prefix_token_ids")


class ContractBroken(AssertionError):
    """The server's answer is one NeMo-Gym's client would fail on."""


def gym_request(body: Mapping[str, Any], *, inline_ids: bool) -> dict[str, Any]:
    """The body NeMo-Gym sends for ``body`` when it captures token IDs."""
    sent = {**body, "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True}
    if inline_ids:
        sent["return_token_ids"] = True
    if sent.get("n") not in (None, 1):
        raise ContractBroken(f"NeMo-Gym asks for one choice when it captures tokens, not n={sent['n']}")
    return sent


def tokenize_body(request: Mapping[str, Any]) -> dict[str, Any]:
    return {name: request[name] for name in TOKENIZE_FIELDS if name in request}


def gym_tokens(answer: Mapping[str, Any], request: Mapping[str, Any],
               tokenize: Callable[[dict[str, Any]], Mapping[str, Any]]) -> tuple[dict, str]:
    """The turn's three token fields as NeMo-Gym reads them from ``answer``, and which source
    gave them ("message", "inline", "tokenize"); ContractBroken where it would fail."""
    choice = answer["choices"][0]
    message = choice["message"]
    inline = _inline_ids(answer, choice)
    present = [name for name in TOKEN_FIELDS if name in message]
    if present:
        if len(present) != len(TOKEN_FIELDS):
            raise ContractBroken(f"the message carries only {present} of {TOKEN_FIELDS}")
        bundle = {name: message[name] for name in TOKEN_FIELDS}
        if inline is not None and inline != (bundle["prompt_token_ids"],
                                             bundle["generation_token_ids"]):
            raise ContractBroken("the message's token IDs disagree with the inline ones")
        return _checked(bundle), "message"
    generated, logprobs = _logprob_entries(choice)
    if inline is not None:
        prompt, inline_generated = inline
        if inline_generated != generated:
            raise ContractBroken("choice.token_ids disagree with the logprob entries' IDs")
        source = "inline"
    else:
        tokens = tokenize(tokenize_body(request)).get("tokens")
        if not isinstance(tokens, list):
            raise ContractBroken(f"/tokenize answered no token list: {tokens!r}")
        prompt, source = tokens, "tokenize"
    return _checked({"prompt_token_ids": prompt, "generation_token_ids": generated,
                     "generation_log_probs": logprobs}), source


def gym_history_message(message: Mapping[str, Any], tokens: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message as NeMo-Gym sends it back in the next turn: its text and tool
    calls, and the three token fields it attached."""
    sent: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        sent["tool_calls"] = [{"id": call["id"], "type": "function",
                               "function": {"name": call["function"]["name"],
                                            "arguments": call["function"]["arguments"]}}
                              for call in message["tool_calls"]]
    return {**sent, **{name: tokens[name] for name in TOKEN_FIELDS}}


def without_message_tokens(answer: Mapping[str, Any]) -> dict[str, Any]:
    """``answer`` with the message's token fields taken out: what a server that writes only
    vLLM's fields would answer (NeMo-Gym's second and third sources)."""
    choice = answer["choices"][0]
    message = {k: v for k, v in choice["message"].items() if k not in TOKEN_FIELDS}
    return {**answer, "choices": [{**choice, "message": message}]}


def without_inline_ids(answer: Mapping[str, Any]) -> dict[str, Any]:
    choice = {k: v for k, v in answer["choices"][0].items() if k != "token_ids"}
    return {**{k: v for k, v in answer.items() if k != "prompt_token_ids"}, "choices": [choice]}


def _inline_ids(answer: Mapping[str, Any], choice: Mapping[str, Any]) -> tuple[list, list] | None:
    prompt, generated = answer.get("prompt_token_ids"), choice.get("token_ids")
    if (prompt is None) != (generated is None):
        raise ContractBroken("only one of prompt_token_ids and choice.token_ids came back")
    return None if prompt is None else (prompt, generated)


def _logprob_entries(choice: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    block = choice.get("logprobs")
    if not isinstance(block, dict) or not isinstance(block.get("content"), list):
        raise ContractBroken(f"no per-token logprobs came back: choice.logprobs={block!r}")
    generated, logprobs = [], []
    for index, entry in enumerate(block["content"]):
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not token.startswith("token_id:"):
            raise ContractBroken(f"choice.logprobs.content[{index}].token is {token!r}, "
                                 "not token_id:<int>")
        generated.append(int(token.removeprefix("token_id:")))
        logprob = entry.get("logprob")
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            raise ContractBroken(f"choice.logprobs.content[{index}].logprob is {logprob!r}")
        logprobs.append(float(logprob))
    return generated, logprobs


def _checked(bundle: dict[str, Any]) -> dict[str, Any]:
    for name in TOKEN_FIELDS:
        if not isinstance(bundle[name], list):
            raise ContractBroken(f"{name} is not a list: {bundle[name]!r}")
    if len(bundle["generation_token_ids"]) != len(bundle["generation_log_probs"]):
        raise ContractBroken("generation_token_ids and generation_log_probs differ in length")
    return bundle
