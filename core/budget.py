"""Token budget: how many tokens a prompt may generate within the model's context."""

from __future__ import annotations

import enum

from rollout_fleet.core.errors import ContextLimitExceeded, InvalidValue, shown
from rollout_fleet.core.validate import check_int_at_least


class ContextLimitPolicy(str, enum.Enum):
    """What to do with a prompt that already fills the context window."""

    REJECT = "reject"  # raise ContextLimitExceeded (upstream's behaviour; the default)
    EMPTY = "empty"  # answer with an empty generation, finish reason "length"


def token_budget(
    prompt_len: int,
    max_new_tokens: int,
    max_model_len: int,
    policy: ContextLimitPolicy = ContextLimitPolicy.REJECT,
) -> int:
    """``min(max_new_tokens, max_model_len - prompt_len)``; 0 only under the EMPTY policy."""
    check_int_at_least("prompt_len", prompt_len, 0)
    check_int_at_least("max_new_tokens", max_new_tokens, 0)
    check_int_at_least("max_model_len", max_model_len, 0)
    if max_model_len < 1:
        raise InvalidValue("max_model_len", max_model_len, "must be >= 1")
    if type(policy) is not ContextLimitPolicy:  # a member already is one: once per rollout
        policy = _parse_policy(policy)
    room = max_model_len - prompt_len
    if room <= 0:
        if policy is ContextLimitPolicy.REJECT:
            raise ContextLimitExceeded(
                "prompt_len", prompt_len,
                f"leaves no room to generate within max_model_len={shown(max_model_len)} "
                "(context_limit_policy='reject'; use 'empty' to answer with no tokens)",
            )
        return 0
    return min(max_new_tokens, room)


def _parse_policy(value: object) -> ContextLimitPolicy:
    try:
        return ContextLimitPolicy(value)
    except ValueError:
        allowed = ", ".join(p.value for p in ContextLimitPolicy)
        raise InvalidValue("context_limit_policy", value, f"must be one of {allowed}") from None
