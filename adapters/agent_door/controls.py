"""The door's controls, ``POST /door/control/<name>``, for the trainer: NeMo-RL's
``setup_token_capture`` and ``set_rollout_weight_version`` (and ``token_capture_status``), and
the checkpoint fence's four (``fence.py``).

Checked as a worker's controls are: the body's ``control_secret`` first (401 for a missing or
wrong one, whatever the name or the body; a door started without a secret takes no control),
then 404 for an unknown name, 400 for a body that is no object or a field at fault (named);
503 for staging out of reach, 504 for a fence that did not drain in time;
else 200 with ``status: ok``. What a control sets is kept in the store every door process
reads (``door_state.py``): it holds for every process, whichever one the call reached.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from rollout_fleet.adapters.agent_door.capture import DoorCapture
from rollout_fleet.adapters.agent_door.door_state import CaptureSettings, token_digest
from rollout_fleet.adapters.agent_door.fence import FenceNotDrained, Handler
from rollout_fleet.core.capture_records import StagingUnavailable
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.sampling_guard import SamplingProfiles

logger = logging.getLogger(__name__)
CONTROL_ROUTE = "/door/control/{name}"
CONTROL_SECRET_FIELD = "control_secret"
_SETUP_FIELDS = ("dp_cfg", "staging_partition", "capture_media",
                 "generation_prefix_cuts_enabled", "generation_cut_control_token",
                 "generation_cut_control_timeout_s", "generation_prefix_batch_size",
                 "generation_prefix_batch_max_tokens", "sampling", "ray_address")


def _status(status: int, message: str, field: str | None = None) -> web.Response:
    return web.json_response({"status": "error", "error": message, "param": field},
                             status=status)


class DoorControls:
    def __init__(self, capture: DoorCapture, secret: str | None,
                 more: Mapping[str, Handler] | None = None) -> None:
        self.capture = capture
        self._secret = secret
        self._handlers: dict[str, Handler] = {
            "setup_token_capture": self.setup_token_capture,
            "set_rollout_weight_version": self.set_rollout_weight_version,
            "token_capture_status": self.token_capture_status, **(more or {})}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(CONTROL_ROUTE, self.control)

    async def control(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):
            body = None  # not JSON: it carries no secret
        refusal = self._secret_refusal(body)
        if refusal:
            return _status(401, f"control refused: {refusal}")
        name = request.match_info["name"]
        handler = self._handlers.get(name)
        if handler is None:
            return _status(404, f"unknown control {name!r}; the door has {sorted(self._handlers)}")
        if not isinstance(body, dict):
            return _status(400, f"control {name!r}: the body must be a JSON object")
        if self.capture.shared is None:
            return _status(503, "this door keeps no shared state: it takes no control")
        args = {k: v for k, v in body.items() if k != CONTROL_SECRET_FIELD}
        try:
            return web.json_response({"status": "ok", **await handler(args)})
        except InvalidValue as exc:
            return _status(400, str(exc), exc.field)
        except StagingUnavailable as exc:
            return _status(503, str(exc))
        except FenceNotDrained as exc:
            return _status(504, str(exc))

    def _secret_refusal(self, body: Any) -> str | None:
        if self._secret is None:
            return "this door was started without a control secret: it takes no control"
        given = body.get(CONTROL_SECRET_FIELD) if isinstance(body, Mapping) else None
        if not isinstance(given, str):
            return f"the body has no {CONTROL_SECRET_FIELD!r} string"
        if not hmac.compare_digest(given.encode(), self._secret.encode()):
            return f"{CONTROL_SECRET_FIELD!r} does not match this door's"
        return None

    async def setup_token_capture(self, args: dict[str, Any]) -> dict[str, Any]:
        """Install a capture setup for every door process, and stage through it here first:
        a setup this process cannot stage through is taken back (503, saying why)."""
        shared = self.capture.shared
        assert shared is not None
        settings = capture_settings(args)
        before, version = await self.capture.settings()
        installed = await shared.run(shared.state.set_capture, settings)
        try:
            await self.capture.staging(installed)
        except Exception as exc:
            await shared.run(shared.state.set_capture, before)
            logger.warning("token capture setup refused: %s: %s", type(exc).__name__, exc)
            if isinstance(exc, StagingUnavailable):
                raise
            raise StagingUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return _described(installed, version)

    async def set_rollout_weight_version(self, args: dict[str, Any]) -> dict[str, Any]:
        shared = self.capture.shared
        assert shared is not None
        version = args.get("version")
        if type(version) is not int or version < 0:
            raise InvalidValue("version", version, "a rollout weight version is an integer >= 0")
        await shared.run(shared.state.set_weight_version, version)
        return {"weight_version": version}

    async def token_capture_status(self, _args: dict[str, Any]) -> dict[str, Any]:
        settings, version = await self.capture.settings()
        return _described(settings, version)


def _described(settings: CaptureSettings | None, version: int) -> dict[str, Any]:
    if settings is None:
        return {"set_up": False, "weight_version": version}
    return {"set_up": True, "setup": settings.setup, "weight_version": version,
            "staging_partition": settings.staging_partition,
            "generation_prefix_cuts_enabled": settings.cuts_enabled,
            "sampling": settings.sampling.to_wire() if settings.sampling else None}


def _flag(args: Mapping[str, Any], name: str) -> bool:
    value = args.get(name, False)
    if not isinstance(value, bool):
        raise InvalidValue(name, value, "must be true or false")
    return value


def capture_settings(args: Mapping[str, Any]) -> CaptureSettings:
    """A ``setup_token_capture`` call's fields (NeMo-RL's names), checked by name."""
    for name in args:
        if name not in _SETUP_FIELDS:
            raise InvalidValue(name, args[name], f"is not a field of setup_token_capture "
                                                 f"({', '.join(_SETUP_FIELDS)})")
    dp_cfg, partition = args.get("dp_cfg"), args.get("staging_partition")
    if not isinstance(dp_cfg, dict) or dp_cfg.get("impl", "transfer_queue") != "transfer_queue":
        raise InvalidValue("dp_cfg", dp_cfg, "must be NeMo-RL's data-plane config of "
                                             "TransferQueue (impl: transfer_queue)")
    if not isinstance(partition, str) or not partition:
        raise InvalidValue("staging_partition", partition, "must be a partition's name")
    if _flag(args, "capture_media"):
        raise InvalidValue("capture_media", True, "media capture is not served by this door")
    cuts = _flag(args, "generation_prefix_cuts_enabled")
    token = args.get("generation_cut_control_token")
    if cuts and (not isinstance(token, str) or not token):
        raise InvalidValue("generation_cut_control_token", None if token is None else "(set)",
                           "generation-prefix cuts need a non-empty bearer token")
    timeout = args.get("generation_cut_control_timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or not timeout > 0):
        raise InvalidValue("generation_cut_control_timeout_s", timeout, "must be > 0 seconds")
    address = args.get("ray_address")
    if address is not None and (not isinstance(address, str) or not address):
        raise InvalidValue("ray_address", address, "must be a Ray cluster's address")
    sampling = args.get("sampling")
    return CaptureSettings(
        dict(dp_cfg), partition, address, cuts,
        token_digest(token) if cuts and isinstance(token, str) else None,
        float(timeout or 30.0), SamplingProfiles.from_wire(sampling) if sampling else None)
