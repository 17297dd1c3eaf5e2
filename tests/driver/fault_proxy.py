"""A loopback HTTP proxy in front of a real frontend that injects faults on purpose.

Each completion attempt is recorded (its x-request-id); queued faults answer instead of the
frontend (a status, or a reset connection); everything else is forwarded as-is.
"""

from __future__ import annotations

import socket
import threading
from collections import deque

import aiohttp
from aiohttp import web

from rollout_fleet.core.wire import REQUEST_ID_HEADER
from rollout_fleet.core.loop_thread import LoopThread
from tests.http.loopback_frontend import Fault


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.faults: deque[Fault] = deque()
        self.attempt_ids: list[str | None] = []
        self._lock = threading.Lock()
        self._loop = LoopThread()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = f"http://127.0.0.1:{self._loop.run(self._start())}"

    async def _start(self) -> int:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/v1/completions", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        return sock.getsockname()[1]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.attempt_ids.append(request.headers.get(REQUEST_ID_HEADER))
            fault = self.faults.popleft() if self.faults else None
        if fault is not None and fault.reset:
            request.transport.abort()
            return web.Response(status=500)
        if fault is not None:
            return web.json_response({"error": {"message": f"injected {fault.status}"}},
                                     status=fault.status, headers=fault.headers)
        body = await request.read()
        async with self._session.post(self.upstream + "/v1/completions", data=body,
                                      headers={"content-type": "application/json"}) as answer:
            return web.Response(status=answer.status, body=await answer.read(),
                                content_type="application/json")

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
            await self._session.close()
        self._loop.run(stop())
        self._loop.close()
