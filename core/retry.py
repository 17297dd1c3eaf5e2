"""Retry rules as pure functions: which outcomes are worth another attempt, and when.

Nothing here sleeps; the rollout client sleeps through an injected clock.
"""

from __future__ import annotations

import attrs
from rollout_fleet.core.errors import (
    HttpStatusError,
    InvalidValue,
    TransportError,
    UnreadableBody,
)
from rollout_fleet.core.validate import finite_at_least, positive_int

# 408 timeout, 429 load shed; 5xx are matched by range below. 499 ("client closed request"):
# a client that reads the answer did not close it, so the server cancelled the request (Dynamo's
# frontend answers it when a worker stops under a request); nothing was served, send it again.
_TRANSIENT_4XX = frozenset({408, 429, 499})


def is_transient_status(status: int) -> bool:
    return status in _TRANSIENT_4XX or 500 <= status <= 599


def is_transient(error: BaseException) -> bool:
    """Transport failures, unreadable bodies, HTTP 408/429/499/5xx; never other 4xx or semantic
    errors."""
    if isinstance(error, (TransportError, UnreadableBody)):
        return True
    if isinstance(error, HttpStatusError):
        return is_transient_status(error.status)
    return False


@attrs.frozen
class RetryPolicy:
    """Exponential backoff with proportional jitter.

    Attempt n (1-based) that failed waits ``min(max_delay_s, base_delay_s * backoff**(n-1))``
    scaled by a factor drawn in ``[1 - jitter, 1 + jitter]``, never more than ``max_delay_s``.
    """

    max_attempts: int = attrs.field(default=5, validator=positive_int("retry.max_attempts"))
    base_delay_s: float = attrs.field(default=0.1, validator=finite_at_least("retry.base_delay_s"))
    backoff: float = attrs.field(default=2.0, validator=finite_at_least("retry.backoff"))
    max_delay_s: float = attrs.field(default=5.0, validator=finite_at_least("retry.max_delay_s"))
    jitter: float = attrs.field(default=0.2, validator=finite_at_least("retry.jitter"))

    def __attrs_post_init__(self) -> None:
        if self.backoff < 1:
            raise InvalidValue("retry.backoff", self.backoff, "must be >= 1")
        if self.jitter > 1:
            raise InvalidValue("retry.jitter", self.jitter, "must be in [0, 1]")

    def should_retry(self, attempt: int, error: BaseException) -> bool:
        """After ``attempt`` (1-based) failed with ``error``: is another attempt allowed and useful?"""
        return attempt < self.max_attempts and is_transient(error)

    def delay_s(self, attempt: int, unit_random: float, retry_after_s: float | None = None) -> float:
        """Wait after failed ``attempt``; ``unit_random`` in [0, 1) drives the jitter.

        A server's Retry-After, when given, is a floor (capped by max_delay_s).
        """
        nominal = self._nominal_s(attempt)
        delay = min(self.max_delay_s, nominal * (1.0 - self.jitter + 2.0 * self.jitter * unit_random))
        if retry_after_s is not None and retry_after_s > delay:
            delay = min(retry_after_s, self.max_delay_s)
        return max(0.0, float(delay))

    def _nominal_s(self, attempt: int) -> float:
        if self.base_delay_s == 0:
            return 0.0
        try:  # float power: an int one would build a huge int before the cap applies
            return min(self.max_delay_s, self.base_delay_s * float(self.backoff) ** (attempt - 1))
        except OverflowError:  # far past the cap
            return float(self.max_delay_s)
