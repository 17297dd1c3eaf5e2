"""How long one rollout attempt may take: a bound that follows the request's token budget.

A worker that hangs where it cannot see it (its host stalls, its node is cut off) answers
nothing; the driver's only defence is to give up on the attempt and send it again elsewhere.
A fixed bound must fit the longest rollout, so a short one would wait as long; this bound grows
with ``max_new_tokens`` instead: ``fixed_s + per_token_s * max_new_tokens``, never above
``max_s``. One computation per request; nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import attrs
from rollout_fleet.core.validate import check_int_at_least, finite_at_least

# Generous on purpose: an attempt's time includes its wait in the engine's queue, and a bound
# that fires on a healthy but loaded worker costs the work done so far. 200 tokens: 110 s.
DEFAULT_ATTEMPT_FIXED_S = 60.0
DEFAULT_ATTEMPT_PER_TOKEN_S = 0.25


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
