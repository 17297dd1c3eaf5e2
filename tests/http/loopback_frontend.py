"""A loopback HTTP server that answers like a Dynamo frontend and worker system port.

A real HTTP hop (aiohttp.web on 127.0.0.1, its own event loop in a thread), answered by the
in-memory engine through the same worker-side code a Dynamo worker runs
(``serve_annotated_rollout``). Faults can be queued to exercise the retry rules, and it
records what arrives: request ids per attempt, control bodies, client sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import deque

import attrs
from aiohttp import web

from rollout_fleet.adapters.memory import MemoryEngine
from rollout_fleet.core.wire import REQUEST_ID_HEADER, ROLLOUT_ANNOTATION_PREFIX, find_annotation
from rollout_fleet.core.worker_service import serve_annotated_rollout, status_of_engine_error
from rollout_fleet.core.loop_thread import LoopThread

MODEL = "memory"
SECRET = "s3cret"


@attrs.frozen
class Fault:
    """One injected answer: an HTTP status (with headers), or a connection reset."""

    status: int = 503
    headers: dict = attrs.field(factory=dict)
    reset: bool = False
    hang: bool = False  # never answer (a worker that hangs where nobody sees it)

    @classmethod
    def connection_reset(cls) -> "Fault":
        return cls(reset=True)


class LoopbackFrontend:
    def __init__(self, engine: MemoryEngine | None = None, *, delay_s: float = 0.0) -> None:
        self.engine = engine or MemoryEngine(seed=0, context_length=256)
        self.delay_s = delay_s
        self.faults: deque[Fault] = deque()
        self.attempt_ids: list[str | None] = []  # x-request-id of every completion attempt
        self.control_bodies: list[tuple[str, dict]] = []
        self.flushes = 0
        self.peers: set[tuple] = set()  # client sockets seen (host, port)
        self.active = 0  # completions being answered now, and the most at once
        self.peak_active = 0
        self._lock = threading.Lock()
        self._loop = LoopThread()
        self._runner: web.AppRunner | None = None
        self.port = self._loop.run(self._start())
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/engine/control/{name}", self._control)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock, backlog=2048).start()
        return sock.getsockname()[1]

    def close(self) -> None:
        if self._runner is not None:
            self._loop.run(self._runner.cleanup())
            self._runner = None
        self._loop.close()

    # -- handlers -----------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.peers.add(request.transport.get_extra_info("peername"))
            self.attempt_ids.append(request.headers.get(REQUEST_ID_HEADER))
            fault = self.faults.popleft() if self.faults else None
        if fault is not None:
            if fault.hang:
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.05)  # until the client gives up and goes away
                return web.Response(status=500)
            if fault.reset:
                request.transport.abort()  # the client sees its connection reset
                return web.Response(status=500)
            return web.json_response({"error": {"message": f"injected {fault.status}"}},
                                     status=fault.status, headers=fault.headers)
        body = await request.json()
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            return await self._answer(request, body)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, body: dict) -> web.Response:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if body.get("model") != MODEL:
            return web.json_response({"error": {"message": f"model {body.get('model')!r} not found"}},
                                     status=404)
        annotation = find_annotation((body.get("nvext") or {}).get("annotations"),
                                     ROLLOUT_ANNOTATION_PREFIX)
        if annotation is None:
            return web.json_response({"error": {"message": "not a rollout"}}, status=400)
        try:
            engine_data = await serve_annotated_rollout(self.engine, body.get("prompt"), annotation)
        except Exception as exc:  # noqa: BLE001 - answered as the real worker answers it
            return web.json_response({"error": {"message": f"{type(exc).__name__}: {exc}"}},
                                     status=status_of_engine_error(exc))
        return web.json_response({
            "id": request.headers.get(REQUEST_ID_HEADER, "cmpl"), "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": "",  # a group's samples are in engine_data
                         "finish_reason": engine_data.get("finish_reason", "stop")}],
            "nvext": {"engine_data": engine_data}})

    async def _control(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = json.loads(await request.read())
        with self._lock:
            self.control_bodies.append((name, body))
        if body.get("control_secret") != SECRET:  # as a worker answers it
            return web.json_response({"status": "error", "message": "bad control secret"}, status=401)
        if name == "refuse_with_401_text":  # a refusal whose body says nothing of it
            return web.Response(status=401, text="unauthorized")
        if name == "flush_cache":
            await self.engine.reset_cache()
            self.flushes += 1
            return web.json_response({"status": "ok", "flushed": True})
        if name == "weight_version":
            return web.json_response({"status": "ok", "weight_version": self.engine.weight_version()})
        if name == "refuse_with_200":
            return web.json_response({"status": "error", "message": "refused on purpose"})
        return web.Response(status=404, text="no such route")

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP dynamo_component_inflight_requests in flight\n"
            "# TYPE dynamo_component_inflight_requests gauge\n"
            f'dynamo_component_inflight_requests{{dynamo_component="backend"}} '
            f"{len(self.engine.in_flight)}\n"
            'dynamo_component_gpu_cache_usage_percent{dp_rank="0"} 0.25\n'
            'dynamo_component_gpu_cache_usage_percent{dp_rank="1"} 0.125\n'
            f"rollout_fleet_generated_tokens_total {float(self.engine.served_count * 3)}\n"
            "dynamo_work_handler_queue_depth 0\n"
            f"rollout_fleet_prefix_cache_queried_tokens_total {float(self.engine.served_count * 8)}\n"
            f"rollout_fleet_prefix_cache_hit_tokens_total {float(self.engine.served_count * 4)}\n")
        return web.Response(text=text)
