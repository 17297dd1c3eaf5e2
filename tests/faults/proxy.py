"""A small HTTP/1.1 proxy on loopback that injects faults between the driver and the frontend.

It reads each request (head + Content-Length body) from a kept-alive client connection, asks a
``plan`` what to do with it, and then forwards it (one upstream connection per request) or
answers with a fault:

* ``Shed(retry_after)``: 503 with Retry-After, the request never reaches the frontend;
* ``Truncate()``: forward, then send the answer's head and half its body, and close;
* ``Corrupt()``: forward, then send the answer with its body replaced by same-length garbage;
* ``Reset()``: close the client's connection with a TCP RST (SO_LINGER 0) before answering;
* ``Stall(seconds)``: hold the request that long before forwarding it.

Every request is recorded (arrival and answer times, request id, fault) so a test can check
what the driver did: how often each rollout was sent, and how long it waited between attempts.
The proxy runs its own event loop in a thread, so blocking test code can use it.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

REQUEST_ID_HEADER = b"x-request-id"


@attrs.frozen
class Forward:
    pass


@attrs.frozen
class Shed:
    retry_after: str | None = "0"


@attrs.frozen
class Truncate:
    pass


@attrs.frozen
class Corrupt:
    pass


@attrs.frozen
class Reset:
    pass


@attrs.frozen
class Stall:
    seconds: float


Fault = Forward | Shed | Truncate | Corrupt | Reset | Stall


@attrs.define
class Seen:
    """One request as the proxy saw it."""

    request_id: str
    path: str
    attempt: int  # 1-based, per request id
    fault: Any
    arrived_at: float  # time.monotonic()
    answered_at: float | None = None  # when the answer (or fault) was fully written
    upstream_status: int | None = None


class FaultProxy:
    """``start()`` -> listens on 127.0.0.1:<port>, forwards to ``upstream`` (host, port)."""

    def __init__(self, upstream_port: int, plan: Callable[[str, int], Fault] | None = None,
                 upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.plan = plan or (lambda _rid, _attempt: Forward())
        self.seen: list[Seen] = []
        self.port: int | None = None
        self._attempts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._clients: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve_client, "127.0.0.1", 0, backlog=4096))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        loop, self._loop = self._loop, None

        async def close() -> None:
            self._server.close()
            for writer in list(self._clients):
                writer.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:  # connections still being served
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- what was seen ------------------------------------------------------------------------
    def attempts_of(self, request_id: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.request_id == request_id]

    def by_request(self) -> dict[str, list[Seen]]:
        out: dict[str, list[Seen]] = {}
        with self._lock:
            for s in self.seen:
                out.setdefault(s.request_id, []).append(s)
        return out

    # -- serving ------------------------------------------------------------------------------
    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                keep_open = await self._handle(request, writer)
                if not keep_open:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return  # the client went away, or the proxy is stopping
        finally:
            self._clients.discard(writer)
            if not writer.is_closing():
                writer.close()

    async def _handle(self, request: "_Request", writer: asyncio.StreamWriter) -> bool:
        request_id = request.headers.get(REQUEST_ID_HEADER, b"").decode() or f"no-id:{request.path}"
        with self._lock:
            attempt = self._attempts[request_id] = self._attempts.get(request_id, 0) + 1
        fault = self.plan(request_id, attempt)
        seen = Seen(request_id, request.path, attempt, fault, time.monotonic())
        with self._lock:
            self.seen.append(seen)
        if isinstance(fault, Shed):
            extra = b"" if fault.retry_after is None else b"retry-after: " + fault.retry_after.encode() + b"\r\n"
            body = b'{"error":"overloaded: shed by the fault proxy"}'
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                         + extra + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            seen.answered_at = time.monotonic()
            return True
        if isinstance(fault, Reset):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            seen.answered_at = time.monotonic()
            return False
        if isinstance(fault, Stall):
            await asyncio.sleep(fault.seconds)
        status, head, body = await self._forward(request)
        seen.upstream_status = status
        if isinstance(fault, Truncate):
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            writer.close()
            seen.answered_at = time.monotonic()
            return False
        if isinstance(fault, Corrupt):
            body = bytes((b ^ 0x5A) for b in body)  # same length, no longer JSON
        writer.write(head + body)
        await writer.drain()
        seen.answered_at = time.monotonic()
        return True

    async def _forward(self, request: "_Request") -> tuple[int, bytes, bytes]:
        """Send the request upstream on a new connection; the answer's head (re-framed with a
        Content-Length) and body."""
        reader, writer = await asyncio.open_connection(*self.upstream)
        try:
            headers = b"".join(name + b": " + value + b"\r\n" for name, value in request.headers.items()
                               if name not in (b"connection", b"keep-alive"))
            writer.write(request.request_line + b"\r\n" + headers + b"connection: close\r\n\r\n"
                         + request.body)
            await writer.drain()
            status_line, answer_headers = await _read_head(reader)
            body = await _read_body(reader, answer_headers)
        finally:
            writer.close()
        status = int(status_line.split()[1])
        kept = b"".join(name + b": " + value + b"\r\n" for name, value in answer_headers.items()
                        if name not in (b"connection", b"keep-alive", b"transfer-encoding",
                                        b"content-length"))
        head = (status_line + b"\r\n" + kept + b"content-length: " + str(len(body)).encode()
                + b"\r\n\r\n")
        return status, head, body


@attrs.frozen
class _Request:
    request_line: bytes
    path: str
    headers: dict[bytes, bytes]
    body: bytes


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw[:-4].split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return lines[0], headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> bytes:
    if b"content-length" in headers:
        return await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return body
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    return await reader.read()  # until the upstream closes


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    try:
        request_line, headers = await _read_head(reader)
    except asyncio.IncompleteReadError:
        return None  # the client closed its kept-alive connection
    body = await _read_body(reader, headers) if b"content-length" in headers else b""
    parts = request_line.split()
    return _Request(request_line, parts[1].decode() if len(parts) > 1 else "", headers, body)
