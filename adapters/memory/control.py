"""LocalWorkerControl: the worker-control port answered by handlers in the same process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rollout_fleet.core.errors import ControlRefused, RolloutFleetError
from rollout_fleet.ports.control import WorkerControl

Handler = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]


class LocalWorkerControl(WorkerControl):
    """``address``: how in-process peers find this worker when a call is relayed (None: only
    the driver calls it); ``calls``: the names of the calls it was given, in order."""

    def __init__(self, worker_id: str, handlers: Mapping[str, Handler], *,
                 address: str | None = None) -> None:
        self.worker_id = worker_id
        self._handlers = dict(handlers)
        self._address = address
        self.calls: list[str] = []

    def relay_address(self) -> str | None:
        return self._address

    async def call(self, name: str, body: Mapping[str, Any], *, timeout_s: float | None = None
                   ) -> Mapping[str, Any]:
        self.calls.append(name)
        handler = self._handlers.get(name)
        if handler is None:
            raise ControlRefused(f"worker {self.worker_id} has no control {name!r}; "
                                 f"it has {sorted(self._handlers)}")
        try:
            answer = await handler(body)
        except RolloutFleetError as exc:
            raise ControlRefused(f"worker {self.worker_id} refused {name}: {exc}") from exc
        return {"status": "ok", **answer}
