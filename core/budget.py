"""A rollout's budgets: how many tokens its prompt may generate within the model's context
(``token_budget``), and how long one attempt at them may take (``AttemptTimeout``).

A worker that hangs where it cannot see it (its host stalls, its node is cut off) answers
nothing; the driver's only defence is to give up on the attempt and send it again elsewhere.
A fixed bound must fit the longest rollout, so a short one would wait as long; the attempt's
bound grows with its token budget instead: ``fixed_s + per_token_s * max_new_tokens``, never
above ``max_s``. One computation per request; nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import enum

import attrs
from rollout_fleet.core.errors import ContextLimitExceeded, InvalidValue, shown
from rollout_fleet.core.validate import check_int_at_least, finite_at_least

# Generous on purpose: an attempt's time includes its wait in the engine's queue, and a bound
# that fires on a healthy but loaded worker costs the work done so far. 200 tokens: 110 s.
DEFAULT_ATTEMPT_FIXED_S = 60.0
DEFAULT_ATTEMPT_PER_TOKEN_S = 0.25


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


@attrs.frozen
class AttemptTimeout:
    """``bound_s(n)``: the longest an attempt generating up to ``n`` tokens may take."""

    fixed_s: float = attrs.field(default=DEFAULT_ATTEMPT_FIXED_S,
                                 validator=finite_at_least("attempt_fixed_s", strictly=True))
    per_token_s: float = attrs.field(default=DEFAULT_ATTEMPT_PER_TOKEN_S,
                                     validator=finite_at_least("attempt_per_token_s"))
    max_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(
        finite_at_least("request_timeout_s", strictly=True)))

    def bound_s(self, max_new_tokens: int) -> float:
        check_int_at_least("max_new_tokens", max_new_tokens, 0)
        bound = self.fixed_s + self.per_token_s * max_new_tokens
        return bound if self.max_s is None or bound < self.max_s else self.max_s
