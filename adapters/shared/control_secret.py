"""The control secret as every control body carries it: the field's name, and the check of a
body against the secret its server holds."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

CONTROL_SECRET_FIELD = "control_secret"


def secret_refusal(body: Any, secret: str, holder: str) -> str | None:
    """Why ``body`` does not carry ``secret`` (None when it does; compared in constant time).
    ``holder`` names the server in the reason (``this worker's``)."""
    given = body.get(CONTROL_SECRET_FIELD) if isinstance(body, Mapping) else None
    if not isinstance(given, str):
        return f"the body has no {CONTROL_SECRET_FIELD!r} string"
    if not hmac.compare_digest(given.encode(), secret.encode()):
        return f"{CONTROL_SECRET_FIELD!r} does not match {holder}"
    return None


def without_secret(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body as the control's handler gets it."""
    return {key: value for key, value in body.items() if key != CONTROL_SECRET_FIELD}
