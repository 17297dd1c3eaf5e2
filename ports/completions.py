"""Completions transport port: the driver's one way to reach the frontend.

Declared in core (``rollout_fleet.core.rollout_client``), beside the rollout client written
against it; the core may not import ports.
"""

from rollout_fleet.core.rollout_client import CompletionsTransport, TransportResponse

__all__ = ["CompletionsTransport", "TransportResponse"]
