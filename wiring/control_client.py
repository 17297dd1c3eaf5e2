"""A blocking client of a worker's controls over urllib: the fleet's start-up checks and the
CLI use it; the driver's controls go through the http adapter (``adapters/http/control.py``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from rollout_fleet.adapters.shared.control_secret import CONTROL_SECRET_FIELD


def call_control(control_url: str, name: str, secret: str, body: dict | None = None,
                 timeout_s: float = 30.0) -> dict[str, Any]:
    """A blocking control call (start-up checks, the CLI); the driver uses the http adapter."""
    payload = json.dumps({**(body or {}), CONTROL_SECRET_FIELD: secret}).encode()
    request = urllib.request.Request(f"{control_url}/engine/control/{name}", data=payload,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status, data = answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        if refused.code not in (401, 403):
            raise
        status, data = refused.code, _json_or_text(refused.read())
    if status != 200 or not isinstance(data, dict) or data.get("status") != "ok":
        raise ValueError(f"control {name} answered HTTP {status}: {data!r:.300}")
    return data


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace")


def health_ready(control_url: str) -> bool:
    """Dynamo's own readiness of a worker: its endpoint is registered and serving."""
    try:
        with urllib.request.urlopen(f"{control_url}/health", timeout=2.0) as answer:
            return json.load(answer).get("status") == "ready"
    except (OSError, ValueError, AttributeError):
        return False
