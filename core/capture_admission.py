"""NeMo-Gym's admission of one model call for token capture: the ``ng_capture`` object of a
chat request (Gym's ``CaptureAdmission``, staging schema 2), parsed once into a checked value
(pure).

A trajectory's first call is a ``text`` root: no parent, no prefix. Every later call is
``token_in``: it names its parent call and the parent's chain hash, and the first ``prev_len``
tokens of its prompt must be exactly the tokens of the trajectory so far. Gym sends that
prefix inline (``required_prefix_token_ids``) or names the staged rows whose deltas make it
up (``staging_chain``, root first), which the worker reads back from staging.

Every refusal is a ``CaptureRefused`` naming the field (``ng_capture.<name>``) and its value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from rollout_fleet.core.capture_digest import STAGING_SCHEMA_VERSION, is_digest, is_token_id
from rollout_fleet.core.errors import InvalidValue

CAPTURE_FIELD = "ng_capture"
CaptureMode = Literal["text", "token_in"]
CAPTURE_MODES = ("text", "token_in")
_WIRE_FIELDS = ("schema_version", "rollout_id", "model_call_id", "parent_call_id", "prev_len",
                "mode", "required_prefix_token_ids", "staging_chain", "parent_chain_hash",
                "generation_cut")
_REQUIRED = ("rollout_id", "model_call_id", "mode")


class CaptureRefused(InvalidValue):
    """A capture admission, or the prefix or turn offered for it, breaks NeMo-Gym's
    contract; names the field and the value at fault."""


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """Where a call's row is staged: ``<rollout_id>/<model_call_id>`` (Gym's and NeMo-RL's)."""
    if not rollout_id or not model_call_id:
        raise CaptureRefused("staging key", (rollout_id, model_call_id),
                             "rollout_id and model_call_id must both be non-empty")
    return f"{rollout_id}/{model_call_id}"


def _is_identifier(value: object) -> bool:
    return isinstance(value, str) and value != ""


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _checked(test: Callable[[object], bool], rule: str) -> Callable[[Any, Any, Any], None]:
    """An attrs validator refusing, by the field's wire name, what ``test`` rejects."""
    def validate(_: Any, attribute: Any, value: Any) -> None:
        if not test(value):
            raise CaptureRefused(f"{CAPTURE_FIELD}.{attribute.name}", value, rule)
    return validate


def _optional(test: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or test(value)


def _tuple_of(test: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, tuple) and all(test(item) for item in value)


@attrs.frozen
class CaptureAdmission:
    """One admitted model call: who it is, what it continues, and the prefix it must keep."""

    rollout_id: str = attrs.field(validator=_checked(_is_identifier, "must be non-empty text"))
    model_call_id: str = attrs.field(validator=_checked(_is_identifier,
                                                        "must be non-empty text"))
    mode: CaptureMode = attrs.field(validator=_checked(
        lambda value: value in CAPTURE_MODES, "must be 'text' (a root) or 'token_in'"))
    parent_call_id: str | None = attrs.field(default=None, validator=_checked(
        _optional(_is_identifier), "must be non-empty text or null"))
    prev_len: int = attrs.field(default=0, validator=_checked(
        _is_count, "must be an integer >= 0 (the tokens of the trajectory so far)"))
    required_prefix_token_ids: tuple[int, ...] = attrs.field(default=(), validator=_checked(
        _tuple_of(is_token_id), "must be a list of token IDs (integers in [0, 2**64))"))
    staging_chain: tuple[str, ...] = attrs.field(default=(), validator=_checked(
        _tuple_of(_is_identifier), "must be a list of non-empty staging keys"))
    parent_chain_hash: str | None = attrs.field(default=None, validator=_checked(
        _optional(is_digest), "must be a lowercase SHA-256 hex digest or null"))
    schema_version: int = attrs.field(default=STAGING_SCHEMA_VERSION, validator=_checked(
        lambda value: type(value) is int and value == STAGING_SCHEMA_VERSION,
        f"must be {STAGING_SCHEMA_VERSION}: the staging schema this fleet speaks"))

    def __attrs_post_init__(self) -> None:
        if self.mode == "token_in":
            self._check_continuation()
        else:
            self._check_root()

    def _check_continuation(self) -> None:
        if self.parent_call_id is None:
            self._refuse("parent_call_id", "a token_in call names the call it continues")
        if self.prev_len == 0:
            self._refuse("prev_len", "a token_in call continues a prefix of at least one token")
        if self.parent_chain_hash is None:
            self._refuse("parent_chain_hash", "a token_in call carries its parent's chain hash")
        if not self.staging_chain and len(self.required_prefix_token_ids) != self.prev_len:
            raise CaptureRefused(f"{CAPTURE_FIELD}.required_prefix_token_ids",
                                 f"{len(self.required_prefix_token_ids)} token IDs",
                                 f"must hold prev_len={self.prev_len} token IDs when no "
                                 "staging_chain names the prefix")

    def _check_root(self) -> None:
        for name, empty in (("parent_call_id", None), ("prev_len", 0),
                            ("required_prefix_token_ids", ()), ("staging_chain", ()),
                            ("parent_chain_hash", None)):
            if getattr(self, name) != empty:
                self._refuse(name, "a text call is a trajectory's root: it has no parent, "
                                   "prefix, staging chain or parent chain hash")

    def _refuse(self, name: str, rule: str) -> None:
        raise CaptureRefused(f"{CAPTURE_FIELD}.{name}", getattr(self, name), rule)

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.model_call_id)

    @classmethod
    def from_wire(cls, value: object) -> CaptureAdmission:
        """The request's ``ng_capture`` object, checked against Gym's schema 2: no unknown
        field, exact types (a bool is no integer), the lineage rules above."""
        if not isinstance(value, Mapping):
            raise CaptureRefused(CAPTURE_FIELD, value,
                                 "must be an object (NeMo-Gym's CaptureAdmission)")
        for name in value:
            if name not in _WIRE_FIELDS:
                raise CaptureRefused(f"{CAPTURE_FIELD}.{name}", value[name],
                                     "is not a field of NeMo-Gym's CaptureAdmission (schema 2)")
        if value.get("generation_cut") is not None:
            raise CaptureRefused(f"{CAPTURE_FIELD}.generation_cut", "(a continuation)",
                                 "continuing a checkpointed generation is not supported: "
                                 "this fleet makes no generation-prefix cuts")
        for name in _REQUIRED:
            if name not in value:
                raise CaptureRefused(f"{CAPTURE_FIELD}.{name}", None, "is required")
        fields = {name: value[name] for name in _WIRE_FIELDS
                  if name in value and name != "generation_cut"}
        for name in ("required_prefix_token_ids", "staging_chain"):
            if name in fields:
                fields[name] = _as_tuple(fields[name], name)
        return cls(**fields)

    def to_wire(self) -> dict[str, Any]:
        """As Gym writes it (``model_dump(mode="json")``)."""
        return {"schema_version": self.schema_version, "rollout_id": self.rollout_id,
                "model_call_id": self.model_call_id, "parent_call_id": self.parent_call_id,
                "prev_len": self.prev_len, "mode": self.mode,
                "required_prefix_token_ids": list(self.required_prefix_token_ids),
                "staging_chain": list(self.staging_chain),
                "parent_chain_hash": self.parent_chain_hash, "generation_cut": None}

    def resolve_prefix(self, resolved: Sequence[int] | None, *,
                       field: str = "prefix") -> tuple[int, ...]:
        """The exact tokens this call's prompt must begin with. ``resolved`` is the prefix
        read back from the staging chain (None where none was read; ``field`` names where it
        came from): a text root takes none, a staging-chain admission needs it, and it must
        hold ``prev_len`` tokens and agree with an inline prefix."""
        if resolved is not None and not all(is_token_id(token) for token in resolved):
            raise CaptureRefused(field, list(resolved), "must be token IDs")
        if self.mode == "text":
            if resolved:
                raise CaptureRefused(field, f"{len(resolved)} token IDs",
                                     "a text root continues no prefix")
            return ()
        if resolved is None:
            if self.staging_chain:
                raise CaptureRefused(field, None, "a staging_chain admission needs its prefix "
                                                  "read back from staging")
            return self.required_prefix_token_ids
        if len(resolved) != self.prev_len:
            raise CaptureRefused(field, f"{len(resolved)} token IDs",
                                 f"must hold prev_len={self.prev_len} tokens")
        if self.required_prefix_token_ids and tuple(resolved) != self.required_prefix_token_ids:
            raise CaptureRefused(field, f"{len(resolved)} token IDs",
                                 "differ from the admission's required_prefix_token_ids")
        return tuple(resolved)


def _as_tuple(value: object, name: str) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise CaptureRefused(f"{CAPTURE_FIELD}.{name}", value, "must be a list")
    return tuple(value)
