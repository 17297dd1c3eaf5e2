"""The control surface of a worker's Dynamo adapter (``WorkerControls``, a part of
``DynamoEngineAdapter``) and the ledger of its serving the two share (``ServingLedger``): the
named controls served on the worker's system port, each call checked for the control secret
first (401 without it, and nothing else said), then 404 for an unknown control; the built-in
ones (stats, abort a rollout, and for a refit target: flush the cache, the weight version)
and any the engine kind adds; the first successful refit lets a held worker serve."""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
from rollout_fleet.adapters.shared.control_secret import (  # noqa: F401 - the field: public here
    CONTROL_SECRET_FIELD, secret_refusal, without_secret,
)
from rollout_fleet.core.control_relay import ControlRelay, PeerControls
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit_service import WorkerWeights
from rollout_fleet.ports.engine import EnginePort, RefitTarget

logger = logging.getLogger(__name__)

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# The controls whose first success lets a worker that joined late serve (a refit completed).
_FIRST_REFIT_CONTROLS = ("update_weights", "colocated_finish", "reload_weights")
_RECENT_ABORTS_KEPT = 256


@attrs.define(eq=False)
class ServingLedger:
    """What a worker's adapter records of its serving: written by the adapter as it serves,
    read (and the hold lifted) by its controls."""

    # Dynamo's context id -> the request id the engine knows (a rollout's own id).
    in_flight: dict[str, str] = attrs.field(factory=dict)
    counts: collections.Counter = attrs.field(factory=collections.Counter)
    recent_aborts: collections.deque = attrs.field(
        factory=lambda: collections.deque(maxlen=_RECENT_ABORTS_KEPT))
    instance_id: int | None = None  # Dynamo's id of this worker, once started
    dead_reason: str | None = None  # set once the engine died
    # A worker that joined a running fleet serves nothing until its first refit has loaded the
    # fleet's current weights (the ``update_weights`` control succeeded).
    held: bool = False
    controls_running: int = 0  # a refit may pause the engine: no progress is no hang then


class WorkerControls:
    """The control table of one worker: the built-in controls over ``engine`` and ``ledger``,
    and those its engine kind adds; each call checked for ``control_secret``. With ``peers``
    (how to reach another worker's controls), ``relay`` too: a call run here and passed on down
    a tree of workers (core/control_relay.py)."""

    def __init__(self, engine: EnginePort, ledger: ServingLedger, *,
                 control_secret: str | None = None,
                 extra: Mapping[str, ControlHandler] | None = None,
                 peers: PeerControls | None = None) -> None:
        self.engine = engine
        self.ledger = ledger
        # The cache flush and the weight version, for an engine that implements the refit port.
        self._refit: RefitTarget | None = engine if isinstance(engine, RefitTarget) else None
        self._control_secret = control_secret
        self._controls: dict[str, ControlHandler] = self._builtin_controls()
        if peers is not None:
            self._controls.update(ControlRelay(self._answer_here, peers).controls())
        for name, handler in (extra or {}).items():
            if name in self._controls:
                raise InvalidValue("controls", name, "collides with a built-in control")
            self._controls[name] = handler

    def supported_controls(self) -> set[str]:
        return set(self._controls)

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        """Dynamo's entry (its system server answers 200 whatever this says)."""
        return (await self.answer_control(control, body))[1]

    async def answer_control(self, control: str, body: Any) -> tuple[int, dict[str, Any]]:
        """(HTTP status, answer) of one control call (``body``: the JSON read, None when it was
        not JSON). The secret first: 401 for a missing or wrong one, which says nothing of the
        worker's controls nor of the body; then 404 for an unknown control, 400 for a body that
        is not a JSON object; else 200 (a failed handler answers ``status: error``)."""
        refusal = self._secret_refusal(body)
        if refusal:
            return 401, _error(f"control refused: {refusal}")
        return await self._answer_trusted(control, body)

    async def _answer_trusted(self, control: str, body: Any) -> tuple[int, dict[str, Any]]:
        """``answer_control`` past the secret's check."""
        handler = self._controls.get(control)
        if handler is None:
            return 404, _error(f"unknown control {control!r}; this worker has {sorted(self._controls)}")
        if not isinstance(body, dict):
            return 400, _error(f"control {control!r}: the body must be a JSON object")
        return 200, await self._run_control(control, handler, body)

    async def _answer_here(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        """A relayed call's answer from this worker (its secret was checked on the relay)."""
        return (await self._answer_trusted(control, body))[1]

    async def _run_control(self, control: str, handler: ControlHandler,
                           body: dict[str, Any]) -> dict[str, Any]:
        args = without_secret(body)
        self.ledger.controls_running += 1
        try:
            answer = await handler(args)
        except Exception as exc:
            logger.warning("control %r failed: %s: %s", control, type(exc).__name__, exc)
            return _error(f"control {control!r} failed: {type(exc).__name__}: {exc}")
        finally:
            self.ledger.controls_running -= 1
        if control in _FIRST_REFIT_CONTROLS and self.ledger.held:
            self.ledger.held = False
            logger.info("serving from now on: the fleet's weights are loaded (version %s)",
                        (answer or {}).get("weight_version"))
        return {"status": "ok", **(answer or {})}

    def _secret_refusal(self, body: Any) -> str | None:
        if self._control_secret is None:
            return None
        return secret_refusal(body, self._control_secret, "this worker's")

    def _builtin_controls(self) -> dict[str, ControlHandler]:
        controls: dict[str, ControlHandler] = {"stats": self._stats,
                                               "abort_rollout": self._abort_rollout}
        if self._refit is not None:  # the core's, as every worker of a refit target serves them
            controls.update(WorkerWeights(self._refit).controls())
        return controls

    async def _abort_rollout(self, body: dict[str, Any]) -> dict[str, Any]:
        """Cut a rollout short: its own request answers with what it generated so far
        (finish reason ``abort``). An id not here yet is remembered by the engine."""
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidValue("request_id", request_id, "must be a non-empty string")
        was_in_flight = request_id in self.ledger.in_flight.values()
        await self.engine.abort(request_id)
        return {"was_in_flight": was_in_flight}

    async def _stats(self, _body: dict[str, Any]) -> dict[str, Any]:
        return {
            "in_flight": len(self.ledger.in_flight),
            "served": self.ledger.counts["served"],
            "rejected": self.ledger.counts["rejected"],
            "failed": self.ledger.counts["failed"],
            "aborted_request_ids": list(self.ledger.recent_aborts),
            "instance_id": self.ledger.instance_id,
            "engine_dead": self.ledger.dead_reason,
            "held": self.ledger.held,
            "held_back": self.ledger.counts["held_back"],
            "refused_asleep": self.ledger.counts["asleep"],
        }


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}
