"""The control surface of a worker's Dynamo adapter (``WorkerControls``, a part of
``DynamoEngineAdapter``): the named controls served on the worker's system port, each body
checked for the control secret (401 without it, 404 for an unknown control), the built-in
ones (stats, abort a rollout, and for a refit target: flush the cache, the weight version)
and any the engine kind adds; the first successful refit lets a held worker serve."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.ports.engine import RefitTarget

logger = logging.getLogger(__name__)

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
CONTROL_SECRET_FIELD = "control_secret"
# The controls whose first success lets a worker that joined late serve (a refit completed).
_FIRST_REFIT_CONTROLS = ("update_weights", "colocated_finish")


class WorkerControls:
    """Uses the adapter's engine, control table, secret, counts and hold (adapter.py)."""

    def supported_controls(self) -> set[str]:
        return set(self._controls)

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        """Dynamo's entry (its system server answers 200 whatever this says)."""
        return (await self.answer_control(control, body))[1]

    async def answer_control(self, control: str, body: Any) -> tuple[int, dict[str, Any]]:
        """(HTTP status, answer) of one control call: 401 for a missing or wrong secret, 404
        for an unknown control, else 200 (a failed handler answers ``status: error``)."""
        handler = self._controls.get(control)
        if handler is None:
            return 404, _error(f"unknown control {control!r}; this worker has {sorted(self._controls)}")
        if not isinstance(body, dict):
            return 200, _error(f"control {control!r}: the body must be a JSON object")
        refusal = self._secret_refusal(body)
        if refusal:
            return 401, _error(f"control {control!r} refused: {refusal}")
        return 200, await self._run_control(control, handler, body)

    async def _run_control(self, control: str, handler: ControlHandler,
                           body: dict[str, Any]) -> dict[str, Any]:
        args = {k: v for k, v in body.items() if k != CONTROL_SECRET_FIELD}
        self._controls_running += 1
        try:
            answer = await handler(args)
        except Exception as exc:
            logger.warning("control %r failed: %s: %s", control, type(exc).__name__, exc)
            return _error(f"control {control!r} failed: {type(exc).__name__}: {exc}")
        finally:
            self._controls_running -= 1
        if control in _FIRST_REFIT_CONTROLS and self._held:
            self._held = False
            logger.info("serving from now on: the fleet's weights are loaded (version %s)",
                        (answer or {}).get("weight_version"))
        return {"status": "ok", **(answer or {})}

    def _secret_refusal(self, body: Mapping[str, Any]) -> str | None:
        if self._control_secret is None:
            return None
        given = body.get(CONTROL_SECRET_FIELD)
        if not isinstance(given, str):
            return f"the body has no {CONTROL_SECRET_FIELD!r} string"
        if not hmac.compare_digest(given.encode(), self._control_secret.encode()):
            return f"{CONTROL_SECRET_FIELD!r} does not match this worker's"
        return None

    def _builtin_controls(self) -> dict[str, ControlHandler]:
        controls: dict[str, ControlHandler] = {"stats": self._stats,
                                               "abort_rollout": self._abort_rollout}
        if isinstance(self.engine, RefitTarget):
            controls["flush_cache"] = self._flush_cache
            controls["weight_version"] = self._weight_version
        return controls

    async def _abort_rollout(self, body: dict[str, Any]) -> dict[str, Any]:
        """Cut a rollout short: its own request answers with what it generated so far
        (finish reason ``abort``). An id not here yet is remembered by the engine."""
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidValue("request_id", request_id, "must be a non-empty string")
        was_in_flight = request_id in self._in_flight.values()
        await self.engine.abort(request_id)
        return {"was_in_flight": was_in_flight}

    async def _flush_cache(self, _body: dict[str, Any]) -> dict[str, Any]:
        await self.engine.reset_cache()  # type: ignore[attr-defined]
        return {}

    async def _weight_version(self, _body: dict[str, Any]) -> dict[str, Any]:
        return {"weight_version": self.engine.weight_version()}  # type: ignore[attr-defined]

    async def _stats(self, _body: dict[str, Any]) -> dict[str, Any]:
        return {
            "in_flight": len(self._in_flight),
            "served": self._counts["served"],
            "rejected": self._counts["rejected"],
            "failed": self._counts["failed"],
            "aborted_request_ids": list(self._recent_aborts),
            "instance_id": self._instance_id,
            "engine_dead": self._dead_reason,
            "held": self._held,
            "held_back": self._counts["held_back"],
            "refused_asleep": self._counts["asleep"],
        }


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}
