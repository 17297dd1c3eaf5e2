"""The worker-control client: named controls on a worker's system port."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rollout_fleet.adapters.http.pool import JSON_CONTENT_TYPE, LoopClients, dumps
from rollout_fleet.adapters.http.settings import HttpSettings
from rollout_fleet.adapters.http.transport import check_base_url
from rollout_fleet.adapters.shared.control_secret import CONTROL_SECRET_FIELD
from rollout_fleet.core.errors import (
    ControlRefused,
    HttpStatusError,
    InvalidValue,
    UnreadableBody,
    WireError,
)
from rollout_fleet.ports.control import WorkerControl

_CONTROL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class HttpWorkerControl(WorkerControl):
    """``POST {control_url}/engine/control/{name}`` with the shared secret in the JSON body.

    Holds only an endpoint and a secret, so a pickled copy reaches the same worker.
    A refusal (HTTP 401/403 for a missing or wrong secret, or ``{"status": "error"}`` whatever
    the HTTP status) raises ControlRefused: the status is checked and the body always read.
    """

    def __init__(self, worker_id: str, control_url: str, *, secret: str,
                 settings: HttpSettings | None = None, clients: LoopClients | None = None) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidValue("worker_id", worker_id, "must be a non-empty string")
        if not isinstance(secret, str):
            raise InvalidValue(CONTROL_SECRET_FIELD, "<hidden>", "must be a string")
        self.worker_id = worker_id
        self.control_url = check_base_url("control_url", control_url)
        self.secret = secret
        self.clients = clients or LoopClients(settings or HttpSettings())

    def url_of(self, name: str) -> str:
        if not isinstance(name, str) or not _CONTROL_NAME.match(name):
            raise InvalidValue("control name", name, "must be letters, digits, '_', '.', '-'")
        return f"{self.control_url}/engine/control/{name}"

    def relay_address(self) -> str:
        return self.control_url

    async def call(self, name: str, body: Mapping[str, Any], *, timeout_s: float | None = None
                   ) -> Mapping[str, Any]:
        url = self.url_of(name)
        if not isinstance(body, Mapping):
            raise InvalidValue(f"body of control {name!r}", body, "must be a JSON object (a mapping)")
        payload = dict(body)
        payload[CONTROL_SECRET_FIELD] = self.secret
        answer = await self.clients.current().post_json(
            url, dumps(payload), {"content-type": JSON_CONTENT_TYPE}, timeout_s)
        return self._read(name, answer.status, answer.body)

    def _read(self, name: str, status: int, body: bytes) -> Mapping[str, Any]:
        where = f"worker {self.worker_id!r} control {name!r}"
        try:
            answer = json.loads(body) if body else None
        except (ValueError, RecursionError):
            answer = None
        if status in (401, 403):  # the worker refused the secret: never a success
            message = answer.get("message") if isinstance(answer, dict) else body[:200]
            raise ControlRefused(f"{where} refused (HTTP {status}): {str(message)[:500]}")
        if isinstance(answer, dict) and answer.get("status") == "error":
            raise ControlRefused(f"{where} refused: {str(answer.get('message'))[:500]}")
        if status == 404:
            raise ControlRefused(f"{where}: the worker has no such control (HTTP 404)")
        if not 200 <= status < 300:
            raise HttpStatusError(status, body[:2000])
        if answer is None:
            raise UnreadableBody(f"{where} answered {status} with a body that is not JSON: {body[:200]!r}")
        if not isinstance(answer, dict):
            raise WireError(f"{where} answered with {type(answer).__name__}, not a JSON object")
        return answer

    def __repr__(self) -> str:  # never print the secret
        return f"HttpWorkerControl({self.worker_id!r}, {self.control_url!r})"


class HttpPeers:
    """A worker's channels to its peers' controls, for the calls it relays on
    (core/control_relay.py): the fleet's secret, one pooled client for all of them."""

    def __init__(self, secret: str, settings: HttpSettings | None = None) -> None:
        self._secret = secret
        self.clients = LoopClients(settings or HttpSettings(max_in_flight=1))

    def control(self, worker_id: str, address: str) -> HttpWorkerControl:
        return HttpWorkerControl(worker_id, address, secret=self._secret, clients=self.clients)

    async def aclose(self) -> None:
        await self.clients.aclose()

    def __repr__(self) -> str:  # never print the secret
        return "HttpPeers()"
