"""Completions transport port: the driver's one way to reach the frontend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import attrs


@attrs.frozen
class TransportResponse:
    status: int
    body: bytes
    retry_after_s: float | None = None  # the server's Retry-After, when it sent one


class CompletionsTransport(ABC):
    """POSTs a completion body; raises ``TransportError`` when no HTTP answer came."""

    @abstractmethod
    async def post_completion(self, body: Mapping[str, Any], *, request_id: str) -> TransportResponse:
        """Send ``body`` to ``/v1/completions`` with ``request_id`` as a header (same on every attempt)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release connections; safe to call twice."""
