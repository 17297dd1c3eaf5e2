"""A request's prompt token IDs, made with the model's chat template and tokenizer (run in a
render thread: ``render.py``), and the checks every prompt passes before it reaches a worker:
each ID inside the tokenizer's vocabulary, the prompt and its token budget inside the model's
context length."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.core.agent_turns import TurnTokens, joined_prompt
from rollout_fleet.core.errors import ContextLimitExceeded, InvalidValue
from rollout_fleet.core.validate import is_int


def chat_prompt(template: ChatTemplate, body: Mapping[str, Any], messages: list[dict[str, Any]],
                known: dict[int, TurnTokens], *, add_generation_prompt: bool = True) -> list[int]:
    """The conversation's prompt: where an earlier assistant turn's exact tokens are known (the
    latest such turn), they are its prefix and only what the template writes after them is
    tokenized (``core.agent_turns.joined_prompt``); else the whole rendering is tokenized."""
    tools = None if body.get("tool_choice") == "none" else body.get("tools")
    render = dict(tools=tools, template_kwargs=body.get("chat_template_kwargs"))
    whole = template.render(messages, add_generation_prompt=add_generation_prompt, **render)
    if not known:
        return template.encode(whole)
    index = max(known)
    earlier = template.render(messages[:index + 1], add_generation_prompt=False, **render)
    prefix, rest = joined_prompt(known[index], earlier, whole, turn_field=f"messages[{index}]",
                                 end_of_turn=template.end_of_turn)
    return list(prefix) + template.encode(rest)


def completion_prompts(template: ChatTemplate, body: Mapping[str, Any]) -> list[list[int]]:
    """Each prompt of a completions request as token IDs: a string is tokenized (special tokens
    added, as the frontend would), a list of IDs taken as it is (checked against the
    vocabulary); a batch is a list of either."""
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and (
        isinstance(prompt[0], (str, list))) else [prompt]
    prompts = []
    for index, one in enumerate(batch):
        field = "prompt" if len(batch) == 1 and batch[0] is prompt else f"prompt[{index}]"
        if isinstance(one, str):
            prompts.append(template.encode(one, special_tokens=True))
            continue
        if not isinstance(one, list) or not one or not all(is_int(t) for t in one):
            raise InvalidValue(field, one, "must be a string or a non-empty list of token IDs "
                                           "(or a list of these)")
        check_vocabulary(field, one, template.vocab_size)
        prompts.append(list(one))
    return prompts


def check_vocabulary(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Refuse, by its index and ID, the first token ID outside the tokenizer's vocabulary."""
    if token_ids and min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return
    for index, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidValue(f"{field}[{index}]", token,
                               f"token ID {token} at index {index} is outside the tokenizer's "
                               f"vocabulary (IDs 0 to {vocab_size - 1})")


def check_known_vocabulary(known: Mapping[int, TurnTokens], vocab_size: int) -> None:
    """The exact tokens a request carries on its assistant messages, each inside the vocabulary."""
    for index, tokens in known.items():
        for name in ("prompt_token_ids", "generation_token_ids"):
            check_vocabulary(f"messages[{index}].{name}", getattr(tokens, name), vocab_size)


def max_tokens_asked(body: Mapping[str, Any], default: int | None = None) -> tuple[str, int | None]:
    """The request's token budget field and value (OpenAI's two spellings), or the default."""
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None:
            if not is_int(value) or value < 1:
                raise InvalidValue(field, value, "must be an int >= 1")
            return field, int(value)
    return "max_tokens", default


def check_context(prompt_field: str, prompt_len: int, budget: tuple[str, int | None],
                  max_model_len: int) -> None:
    """Refuse a prompt that, with its token budget, does not fit the model's context length."""
    field, max_tokens = budget
    if prompt_len >= max_model_len:
        raise ContextLimitExceeded(
            prompt_field, f"{prompt_len} tokens",
            f"the prompt's {prompt_len} tokens leave no room to generate within the model's "
            f"context length of {max_model_len} tokens (max_model_len={max_model_len})")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ContextLimitExceeded(
            field, max_tokens,
            f"the prompt's {prompt_len} tokens + {field} {max_tokens} = "
            f"{prompt_len + max_tokens} tokens exceed the model's context length of "
            f"{max_model_len} tokens (max_model_len={max_model_len})")
