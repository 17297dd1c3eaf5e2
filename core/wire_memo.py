"""A one-entry memo of a wire parse: the same message again is not parsed again.

A refit of the same model sends the same manifest every time (hundreds of tensors' names,
shapes and dtypes); parsing it costs more than some models' whole refit on a GPU. The memo
compares the message with the last one it parsed, as its canonical form (``to_wire`` of the
parse, a structure of its own that no caller holds), and returns that parse when they are equal
(``==``: a message that differs only in spelling a number as an equal bool or float, which the
parse would refuse, gets the earlier parse); anything else is parsed, and checked, as always.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LastParsed(Generic[T]):
    def __init__(self, parse: Callable[[Any], T], to_wire: Callable[[T], Any]) -> None:
        self._parse, self._to_wire = parse, to_wire
        self._last: tuple[Any, T] | None = None

    def __call__(self, wire: Any) -> T:
        last = self._last
        if last is not None and wire == last[0]:
            return last[1]
        value = self._parse(wire)
        self._last = (self._to_wire(value), value)
        return value
