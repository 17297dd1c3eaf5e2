"""NeMo-Gym's generation cuts on the wire (pure; Gym's ``_checkpoint/generation_cut.py`` and
``GenerationCutContinuation`` of staging schema 2, as of Gym 012b7b66).

At a checkpoint, Gym sends each inference server the inventory of the calls it has in flight
(``CutInventory``); the server stages each call's generated prefix durably and answers a
receipt (``CutReceipt``) with one acknowledgement per call (``PrefixAck``): a durable prefix
(where it was staged, how many tokens, their digest) or a durable failure (the call is
regenerated after a restore, which is always correct). After a restore, the call is sent
again with a continuation (``CutContinuation``) naming the staged prefix, and the server
generates only the rest.

Every refusal is an ``InvalidValue`` naming the field (``active_prefixes[0].attempt``,
``ng_capture.generation_cut.staging_keys``) and the value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs

from rollout_fleet.core.capture_admission import CAPTURE_FIELD
from rollout_fleet.core.capture_digest import STAGING_SCHEMA_VERSION, is_digest
from rollout_fleet.core.errors import InvalidValue

CUT_ROUTE = "/ng-control/v1/generation-cut"
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
FinishReason = Literal["stop", "length"]
Check = Callable[[object], bool]


def _text(value: object) -> bool:
    return isinstance(value, str) and value != ""


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _positive(value: object) -> bool:
    return type(value) is int and value >= 1


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field(wire: Mapping[str, Any], name: str, where: str, test: Check, rule: str,
           default: object = ...) -> Any:
    if name not in wire:
        if default is ...:
            raise InvalidValue(f"{where}{name}", None, "is required")
        return default
    value = wire[name]
    if not test(value):
        raise InvalidValue(f"{where}{name}", value, rule)
    return value


def _object(value: object, where: str, fields: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidValue(where.rstrip(".") or "body", value, "must be an object")
    for name in value:
        if name not in fields:
            raise InvalidValue(f"{where}{name}", value[name], "is not a field of this object")
    return value


def capture_key(rollout_id: str, attempt: int) -> str:
    """The rollout id a call of ``attempt`` is captured under (Gym's: ``<id>-a<n>`` past 0)."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


@attrs.frozen
class CutPrefix:
    """One in-flight call of an inventory."""

    ticket_id: str
    rollout_id: str
    attempt: int
    model_call_id: str
    admitted_at: float

    @classmethod
    def from_wire(cls, value: object, where: str) -> CutPrefix:
        wire = _object(value, where, ("ticket_id", "rollout_id", "attempt", "model_call_id",
                                      "admitted_at"))
        return cls(
            _field(wire, "ticket_id", where, _text, "must be non-empty text"),
            _field(wire, "rollout_id", where,
                   lambda v: isinstance(v, str) and _ROLLOUT_ID.fullmatch(v) is not None,
                   "must match [A-Za-z0-9][A-Za-z0-9._-]*"),
            _field(wire, "attempt", where, _count, "must be an integer >= 0"),
            _field(wire, "model_call_id", where, _text, "must be non-empty text"),
            float(_field(wire, "admitted_at", where, _number, "must be a number")))

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.attempt)

    def to_wire(self) -> dict[str, Any]:
        return {"ticket_id": self.ticket_id, "rollout_id": self.rollout_id,
                "attempt": self.attempt, "model_call_id": self.model_call_id,
                "admitted_at": self.admitted_at}


@attrs.frozen
class CutInventory:
    """The calls one server must cut for one checkpoint, bound to it by ``inventory_digest``."""

    checkpoint_id: str
    server_name: str
    active_prefixes: tuple[CutPrefix, ...]
    inventory_digest: str

    @classmethod
    def from_wire(cls, value: object) -> CutInventory:
        wire = _object(value, "", ("checkpoint_id", "server_name", "active_prefixes",
                                   "inventory_digest"))
        listed = _field(wire, "active_prefixes", "", lambda v: isinstance(v, list),
                        "must be a list", default=[])
        prefixes = tuple(CutPrefix.from_wire(item, f"active_prefixes[{index}].")
                         for index, item in enumerate(listed))
        calls = [prefix.model_call_id for prefix in prefixes]
        if len(set(calls)) != len(calls) or len({p.ticket_id for p in prefixes}) != len(calls):
            raise InvalidValue("active_prefixes", calls, "names a call or a ticket twice")
        return cls(_field(wire, "checkpoint_id", "", _text, "must be non-empty text"),
                   _field(wire, "server_name", "", _text, "must be non-empty text"),
                   prefixes,
                   _field(wire, "inventory_digest", "", is_digest,
                          "must be a lowercase SHA-256 hex digest"))

    def to_wire(self) -> dict[str, Any]:
        return {"checkpoint_id": self.checkpoint_id, "server_name": self.server_name,
                "active_prefixes": [prefix.to_wire() for prefix in self.active_prefixes],
                "inventory_digest": self.inventory_digest}


@attrs.frozen
class DurablePrefix:
    """Where a call's generated prefix was staged (the evidence of a durable acknowledgement)."""

    frozen_buffer_id: str
    staging_keys: tuple[str, ...]
    prefix_token_count: int
    prefix_digest: str
    effective_output_limit: int


@attrs.frozen
class PrefixAck:
    """A server's outcome for one call: ``prefix`` staged (``durable_prefix``), or None
    (``durable_failure``: regenerated after a restore)."""

    call: CutPrefix
    prefix: DurablePrefix | None = None

    def to_wire(self) -> dict[str, Any]:
        evidence: dict[str, Any] = {
            "disposition": "durable_failure", "cut_kind": None, "frozen_buffer_id": None,
            "staging_keys": [], "prefix_token_count": None, "prefix_digest": None,
            "effective_output_limit": None}
        if self.prefix is not None:
            evidence = {"disposition": "durable_prefix", "cut_kind": "active_prefix",
                        **attrs.asdict(self.prefix)}
            evidence["staging_keys"] = list(self.prefix.staging_keys)
        return {**self.call.to_wire(), **evidence, "terminal_finish_reason": None,
                "terminal_stop_reason": None}


def receipt(inventory: CutInventory, acks: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The receipt of ``inventory`` (Gym's ``GenerationCutReceipt``): the inventory echoed,
    one acknowledgement per call in its order (``acks``: each ``PrefixAck.to_wire()`` by
    ticket; a call without one is a durable failure)."""
    digest = inventory.inventory_digest
    return {"checkpoint_id": inventory.checkpoint_id, "cut_id": f"door-{digest}",
            "inventory_digest": digest, "inventory": inventory.to_wire(),
            "backend_snapshot_id": f"staging-{digest}",
            "prefixes": [dict(acks.get(prefix.ticket_id) or PrefixAck(prefix).to_wire())
                         for prefix in inventory.active_prefixes]}


_CONTINUATION_FIELDS = ("schema_version", "source_capture_key", "source_model_call_id",
                        "staging_keys", "prefix_token_count", "prefix_digest",
                        "effective_output_limit", "terminal_finish_reason",
                        "terminal_stop_reason")


@attrs.frozen
class CutContinuation:
    """A restored call's ``ng_capture.generation_cut``: the staged prefix it continues."""

    source_capture_key: str
    source_model_call_id: str
    staging_keys: tuple[str, ...]
    prefix_token_count: int
    prefix_digest: str
    effective_output_limit: int
    terminal_finish_reason: FinishReason | None = None

    @classmethod
    def from_wire(cls, value: object) -> CutContinuation:
        where = f"{CAPTURE_FIELD}.generation_cut."
        wire = _object(value, where, _CONTINUATION_FIELDS)
        _field(wire, "schema_version", where, lambda v: v == STAGING_SCHEMA_VERSION and
               type(v) is int, f"must be {STAGING_SCHEMA_VERSION}", default=None)
        keys = _field(wire, "staging_keys", where, lambda v: isinstance(v, list) and bool(v)
                      and all(_text(k) for k in v) and len(set(v)) == len(v),
                      "must be a non-empty list of distinct staging keys")
        finish = _field(wire, "terminal_finish_reason", where,
                        lambda v: v in (None, "stop", "length"), "must be stop, length or null",
                        default=None)
        _field(wire, "terminal_stop_reason", where,
               lambda v: v is None or (finish is not None and isinstance(v, (str, int))),
               "needs a terminal_finish_reason", default=None)
        return cls(
            _field(wire, "source_capture_key", where, _text, "must be non-empty text"),
            _field(wire, "source_model_call_id", where, _text, "must be non-empty text"),
            tuple(keys),
            _field(wire, "prefix_token_count", where, _count, "must be an integer >= 0"),
            _field(wire, "prefix_digest", where, is_digest,
                   "must be a lowercase SHA-256 hex digest"),
            _field(wire, "effective_output_limit", where, _positive,
                   "must be an integer >= 1"),
            finish)


def split_continuation(ng_capture: object) -> tuple[object, CutContinuation | None]:
    """A request's ``ng_capture`` without its ``generation_cut``, and that continuation
    (None where there is none)."""
    if not isinstance(ng_capture, Mapping) or ng_capture.get("generation_cut") is None:
        return ng_capture, None
    admission = {name: value for name, value in ng_capture.items() if name != "generation_cut"}
    return admission, CutContinuation.from_wire(ng_capture["generation_cut"])
