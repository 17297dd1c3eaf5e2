"""Stop strings: the configured set merged with a sample's own, capped."""

from __future__ import annotations

from collections.abc import Iterable

from rollout_fleet.core.errors import InvalidValue, TooManyStopStrings
from rollout_fleet.core.validate import check_int_at_least

MAX_STOP_STRINGS = 32


def merge_stop_strings(
    configured: Iterable[str] | None,
    per_sample: Iterable[str] | None,
    cap: int = MAX_STOP_STRINGS,
) -> tuple[str, ...]:
    """Union in first-seen order (configured first); raise past ``cap``."""
    check_int_at_least("stop string cap", cap, 0)
    merged: dict[str, None] = {}
    for field, group in (("stop_strings (configured)", configured),
                         ("stop_strings (per sample)", per_sample)):
        if group is None:
            continue
        if isinstance(group, str) or not isinstance(group, Iterable):
            raise InvalidValue(field, group, "must be a list of strings")
        for stop in group:
            if not isinstance(stop, str) or not stop:
                raise InvalidValue(field, stop, "each stop string must be a non-empty string")
            merged.setdefault(stop, None)
    if len(merged) > cap:
        raise TooManyStopStrings("stop_strings", f"{len(merged)} strings",
                                 f"at most {cap} after merging configured and per-sample sets")
    return tuple(merged)
