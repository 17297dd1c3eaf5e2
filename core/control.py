"""Worker control port: the driver's channel to one worker (refit, cache flush, versions).
Declared in core, where the driver's services call it; ``rollout_fleet.ports.control`` exports
it with the other ports."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any


class WorkerControl(ABC):
    """Calls a named control on one worker; raises ``ControlRefused`` for a refusal."""

    worker_id: str

    @abstractmethod
    async def call(self, name: str, body: Mapping[str, Any], *, timeout_s: float | None = None
                   ) -> Mapping[str, Any]:
        """Run control ``name`` on the worker; return its answer (status "ok")."""

    def relay_address(self) -> str | None:
        """Where the worker's peers reach its controls, for a call relayed down a tree of
        workers (core/control_relay.py); None: only the driver reaches it (in-process, say)."""
        return None
