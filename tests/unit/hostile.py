"""Hypothesis strategies for hostile input, shared by the property tests (test_properties_*.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Past 4300 digits an int has no repr: built lazily, since hypothesis prints its strategies.
HUGE_INTS = st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400)]) \
    | st.sampled_from([4400, -4400]).map(lambda digits: 10**abs(digits) * (1 if digits > 0 else -1))
HOSTILE_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 1.7e308])
WORDS = st.sampled_from(["", "0", "1", "true", "null", "stop", "length", "abort", "float32",
                         "torch.bfloat16", "rollout:", "rollout:{}", "\x00", "\ud800", "é" * 3])

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), HOSTILE_FLOATS,
    st.text(max_size=20), WORDS,
)
# Finite JSON: what json.dumps(allow_nan=False) accepts; equal to itself after a round trip.
finite_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def nested(depth: int, leaf: Any = 0) -> Any:
    """A list ``depth`` deep, built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


class Deep(list):
    """A deeply nested list whose own repr is short, so hypothesis can print a failing example;
    its items are plain lists, whose repr still hits the recursion limit."""

    def __repr__(self) -> str:
        return f"nested({_depth(self)})"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


def _depth(value: Any) -> int:
    depth = 0
    while isinstance(value, list) and value:
        value, depth = value[0], depth + 1
    return depth


deep_values = st.integers(min_value=1, max_value=5000).map(lambda depth: Deep(nested(depth)))

json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8) | WORDS, inner, max_size=5)
    | st.tuples(inner, inner),
    max_leaves=20,
) | deep_values

# Beyond JSON: what a careless caller might pass in Python.
python_values = json_values | st.sampled_from([object(), b"bytes", bytearray(b"x"), 1j, {1, 2},
                                              frozenset(), range(3), ..., type, len])


def mutated(valid: dict[str, Any], values: st.SearchStrategy = json_values) -> st.SearchStrategy:
    """``valid`` with some fields replaced by hostile values, some dropped, maybe an unknown one added."""
    keys = sorted(valid)

    @st.composite
    def build(draw):
        data = dict(valid)
        for key in draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
            if draw(st.booleans()):
                data[key] = draw(values)
            else:
                del data[key]
        if draw(st.integers(0, 9)) == 0:
            data[draw(st.text(max_size=8))] = draw(values)
        return data

    return build()


def one_field_mutated(valid: dict[str, Any], values: st.SearchStrategy = json_values):
    """(key, ``valid`` with just ``key`` replaced by a hostile value)."""
    return st.tuples(st.sampled_from(sorted(valid)), values).map(
        lambda kv: (kv[0], {**valid, kv[0]: kv[1]}))
