"""When an engine that has work makes no progress: the rule of a worker's hang watchdog.

A hung engine (a wedged kernel, a collective that never returns, a stopped process) does not
die, so nothing reports it; the only sign is that its progress count (steps completed) stops
moving while requests wait on it. An idle engine makes no progress either and is not hung, so
the clock runs only while it is busy. Pure: the caller reads the clock and the count.
"""

from __future__ import annotations

import attrs
from rollout_fleet.core.validate import finite_at_least


@attrs.define
class ProgressWatch:
    """Feed it ``observe(now, progress, busy)`` every so often; it answers how long a busy
    engine has made no progress once that reaches ``hang_timeout_s`` (else None)."""

    hang_timeout_s: float = attrs.field(validator=finite_at_least("hang_timeout_s", strictly=True))
    _last_progress: object = attrs.field(default=None, init=False)
    _since: float | None = attrs.field(default=None, init=False)

    def observe(self, now: float, progress: object, busy: bool) -> float | None:
        if not busy:
            self._since = None  # the clock starts when work is there
            return None
        if progress != self._last_progress or self._since is None:
            self._last_progress, self._since = progress, now
            return None
        stalled = now - self._since
        return stalled if stalled >= self.hang_timeout_s else None
