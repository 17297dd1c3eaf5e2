"""Checks shared by every value class: each names the field and the value it refuses.

Plain functions (``check_*``) raise at once; the attrs validators wrap them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, TypeGuard, TypeVar

from rollout_fleet.core.errors import InvalidValue

V = TypeVar("V", bound="Vocabulary")
# An attrs validator: called with the instance, the attribute and the value; raises to refuse.
Validator = Callable[[Any, Any, Any], None]


def is_finite_number(value: Any) -> bool:
    """A non-bool int or float that is finite as a float (huge ints overflow: not finite)."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> TypeGuard[int | float]:
    """A non-bool int or float (finite or not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int_at_least(field: str, value: Any, low: int, rule: str | None = None) -> int:
    """``value`` when it is an int >= ``low``; else InvalidValue naming field and value."""
    if type(value) is int and value >= low:  # the common case, on every rollout's hot path
        return value
    if not is_int(value) or value < low:
        raise InvalidValue(field, value, rule or f"must be an int >= {low}")
    return value


def check_int_in(field: str, value: Any, low: int, high: int, rule: str | None = None) -> int:
    """``value`` when it is an int in ``low..high`` (both included)."""
    if type(value) is int and low <= value <= high:
        return value
    if not is_int(value) or not low <= value <= high:
        raise InvalidValue(field, value, rule or f"must be an int in {low}..{high}")
    return value


def int_at_least(field: str, low: int) -> Validator:
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        check_int_at_least(field, value, low)
    return check


def positive_int(field: str) -> Validator:
    return int_at_least(field, 1)


def finite_at_least(field: str, low: float = 0.0, *, strictly: bool = False) -> Validator:
    """A finite number >= ``low`` (or > ``low`` when ``strictly``)."""
    relation = ">" if strictly else ">="

    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if not is_finite_number(value) or value < low or (strictly and value == low):
            raise InvalidValue(field, value, f"must be a finite number {relation} {low:g}")
    return check


def non_empty_str(field: str) -> Validator:
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidValue(field, value, "must be a non-empty string")
    return check


def one_of(field: str, allowed: Sequence[Any]) -> Validator:
    """A value among ``allowed``."""
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value not in allowed:
            raise InvalidValue(field, value, f"must be one of {', '.join(map(str, allowed))}")
    return check


def check_bool(field: str, value: Any) -> bool:
    """``value`` itself, when it is a bool (``bool("false")`` is True: nothing is coerced)."""
    if not isinstance(value, bool):
        raise InvalidValue(field, value, "must be true or false")
    return value


def a_bool(field: str) -> Validator:
    """attrs validator: a bool, refused by ``field``'s name otherwise."""
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        check_bool(field, value)
    return check


def check_known_keys(data: Mapping[str, Any], known: Collection[str], prefix: str = "") -> None:
    """Refuse the first key of ``data`` that is not in ``known``, naming it (``prefix`` +
    key) and the known ones."""
    for key in data:
        if key not in known:
            raise InvalidValue(f"{prefix}{key}", data[key], "unknown key (known: "
                               f"{', '.join(sorted(known))})")


class Vocabulary(str, enum.Enum):
    """A closed set of names a setting or a wire field takes (subclass it with the members).

    A value is parsed into its member once, where it arrives (a config file, a wire message),
    and compared as the member from then on. The members are the strings the files and messages
    spell, so each still reads, writes, hashes and compares as that string; ``str(member)`` and
    f-strings give the spelling too (a plain ``str`` mixin gives ``Class.MEMBER`` there)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)

    @classmethod
    def parse(cls: type[V], value: Any, field: str, allowed: Iterable[V] | None = None) -> V:
        """The member spelt ``value`` (among ``allowed``, default all); otherwise InvalidValue
        naming ``field`` and the value, and listing the spellings allowed."""
        members = tuple(cls if allowed is None else allowed)
        try:
            member = cls(value)
        except (ValueError, TypeError):  # TypeError: an unhashable value (a list, a dict)
            member = None
        if member is None or member not in members:
            raise InvalidValue(field, value, f"must be one of {spellings(members)}")
        return member

    @classmethod
    def converter(cls: type[V], field: str, allowed: Iterable[V] | None = None
                  ) -> Callable[[Any], V]:
        """An attrs converter that parses the field's value (``allowed``: as for ``parse``)."""
        members = tuple(cls if allowed is None else allowed)

        def convert(value: Any) -> V:
            return cls.parse(value, field, members)
        return convert


def spellings(members: Iterable[Vocabulary]) -> str:
    """The members as a config file or a message spells them, for an error message."""
    return ", ".join(member.value for member in members)
