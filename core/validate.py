"""attrs validators shared by every value class: each names the field and the value it refuses."""

from __future__ import annotations

import math
from typing import Any

from rollout_fleet.core.errors import InvalidValue


def is_finite_number(value: Any) -> bool:
    """A non-bool int or float that is finite as a float (huge ints overflow: not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def int_at_least(field: str, low: int):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidValue(field, value, f"must be an int >= {low}")
    return check


def positive_int(field: str):
    return int_at_least(field, 1)


def finite_at_least(field: str, low: float = 0.0, *, strictly: bool = False):
    """A finite number >= ``low`` (or > ``low`` when ``strictly``)."""
    relation = ">" if strictly else ">="

    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if not is_finite_number(value) or value < low or (strictly and value == low):
            raise InvalidValue(field, value, f"must be a finite number {relation} {low:g}")
    return check


def non_empty_str(field: str):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidValue(field, value, "must be a non-empty string")
    return check
