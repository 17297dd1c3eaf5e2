"""The worker's system port: controls answered with honest HTTP statuses, the rest Dynamo's.

Dynamo 1.6.1's system server answers an engine route's result with HTTP 200 whatever it says
(or 500 when the handler raises), so a control refused for a missing or wrong secret came back
as 200: a client that checks status codes took the refusal for success. This small server owns
the system port instead: ``POST /engine/control/<name>`` goes to the worker's controls, which say
the status (the secret checked first: 401 for a missing or wrong one, whatever the name or the
body); every other path (``/health``, ``/live``,
``/metrics``) is passed on to Dynamo's own system server, moved to another port of the same
host (which it advertises: the frontend fetches the model's files from it).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web
from rollout_fleet.adapters.dynamo.controls import WorkerControls

logger = logging.getLogger(__name__)
_PASSED_HEADERS = ("content-type",)
_INNER_TIMEOUT_S = 30.0


class ControlFront:
    """``await start(host, port)`` before Dynamo starts (the port is taken, or this fails);
    ``await close()`` when the worker stops."""

    def __init__(self, controls: WorkerControls, inner_url: str) -> None:
        self._controls = controls
        self._inner_url = inner_url.rstrip("/")
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None

    async def start(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_post("/engine/control/{name}", self._control)
        app.router.add_route("*", "/{path:.*}", self._pass_on)
        self._session = ClientSession(timeout=ClientTimeout(total=_INNER_TIMEOUT_S))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, reuse_address=True).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _control(self, request: web.Request) -> web.Response:
        """The controls judge every call, the secret first (whatever the name or the body)."""
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):  # deep nesting recurses
            body = None  # not JSON: it carries no secret, and is no JSON object
        status, answer = await self._controls.answer_control(request.match_info["name"], body)
        return web.json_response(answer, status=status)

    async def _pass_on(self, request: web.Request) -> web.Response:
        assert self._session is not None
        url = f"{self._inner_url}{request.rel_url}"
        try:
            async with self._session.request(request.method, url, data=await request.read(),
                                             headers=_passed(request.headers)) as answer:
                return web.Response(status=answer.status, body=await answer.read(),
                                    headers=_passed(answer.headers))
        except Exception as exc:  # noqa: BLE001 - Dynamo's server not up yet, or gone
            return web.json_response({"status": "notready",
                                      "message": f"{type(exc).__name__}: {exc}"}, status=503)


def _passed(headers: Any) -> dict[str, str]:
    return {name: headers[name] for name in _PASSED_HEADERS if name in headers}
