"""EngineCompletionsTransport: the completions port answered in-process by an engine.

The in-memory twin of the HTTP transport (as httpx's MockTransport is to its network
transports): it reads the body exactly as a worker behind Dynamo does and answers with the
same JSON shape, so the rollout client can be tested end to end without a network. Faults
(statuses, transport errors, corrupted bodies) can be queued to exercise the retry rules.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from rollout_fleet.core.errors import TransportError
from rollout_fleet.core.wire import ROLLOUT_ANNOTATION_PREFIX, find_annotation
from rollout_fleet.core.worker_service import serve_annotated_rollout, status_of_engine_error
from rollout_fleet.ports.completions import CompletionsTransport, TransportResponse
from rollout_fleet.ports.engine import EnginePort


class EngineCompletionsTransport(CompletionsTransport):
    def __init__(self, engine: EnginePort, *, model: str = "memory",
                 faults: Iterable[TransportResponse | BaseException] = (),
                 worker_id: str | None = None) -> None:
        self.engine = engine
        self.worker_id = worker_id  # how a refusal names the worker
        self.model = model
        self.faults: deque[TransportResponse | BaseException] = deque(faults)
        self.seen_request_ids: list[str] = []  # one entry per attempt, in order
        self.closed = False

    async def post_completion(self, body: Mapping[str, Any], *, request_id: str) -> TransportResponse:
        if self.closed:
            raise TransportError("transport is closed")
        self.seen_request_ids.append(request_id)
        if self.faults:
            fault = self.faults.popleft()
            if isinstance(fault, BaseException):
                raise fault
            return fault
        return await self._answer(body)

    async def aclose(self) -> None:
        self.closed = True

    async def _answer(self, body: Mapping[str, Any]) -> TransportResponse:
        if body.get("model") != self.model:
            return _json(404, {"error": {"message": f"model {body.get('model')!r} not found"}})
        prompt = body.get("prompt")
        annotation = find_annotation((body.get("nvext") or {}).get("annotations"),
                                     ROLLOUT_ANNOTATION_PREFIX)
        if annotation is None:
            return _json(400, {"error": {"message": "only rollout requests are served in memory"}})
        try:
            engine_data = await serve_annotated_rollout(self.engine, prompt, annotation,
                                                        worker=self.worker_id)
        except Exception as exc:  # noqa: BLE001 - answered as the real worker answers it
            return _json(status_of_engine_error(exc),
                         {"error": {"message": f"{type(exc).__name__}: {exc}"}})
        return _json(200, {"object": "text_completion", "model": self.model,
                           "choices": [{"index": 0, "text": "",
                                        "finish_reason": engine_data.get("finish_reason", "stop")}],
                           "nvext": {"engine_data": engine_data}})


def _json(status: int, payload: Any) -> TransportResponse:
    return TransportResponse(status, json.dumps(payload).encode())
