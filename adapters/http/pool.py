"""One pooled HTTP client per event loop.

A connection pool belongs to the loop that opened its sockets, so the adapter keeps one
client per running loop, built lazily on first use there. A pickled copy carries only the
settings and builds its own clients in the process that unpickles it.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec
from rollout_fleet.adapters.http.settings import ClientKind, HttpSettings
from rollout_fleet.core.errors import InvalidValue, TransportError

JSON_CONTENT_TYPE = "application/json"
# msgspec's encoder: ~10x less CPU than json.dumps for a rollout body, same JSON text.
_encode = msgspec.json.Encoder().encode


def dumps(payload: Mapping[str, Any]) -> bytes:
    """A request body as JSON bytes; InvalidValue (``body``) when it cannot be encoded."""
    try:
        return _encode(payload)
    except (TypeError, msgspec.EncodeError) as exc:
        raise InvalidValue("body", type(payload).__name__, f"must be JSON-encodable: {exc}") from None


class RawAnswer(NamedTuple):  # a tuple: built once per request on the hot path
    status: int
    body: bytes
    retry_after: str | None = None  # the Retry-After header as sent, when there was one


class LoopClient(ABC):
    """The adapter's view of one pooled client: POST JSON bytes, GET, close."""

    @abstractmethod
    async def post_json(self, url: str, payload: bytes, headers: Mapping[str, str],
                        timeout_s: float | None = None) -> RawAnswer:
        """Raises TransportError when no HTTP answer came (refused, reset, timed out)."""

    @abstractmethod
    async def get(self, url: str, timeout_s: float | None = None) -> RawAnswer: ...

    @abstractmethod
    async def aclose(self) -> None: ...


class AiohttpLoopClient(LoopClient):
    """One aiohttp session with an explicit connection limit: the measured-fastest stack."""

    def __init__(self, settings: HttpSettings) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._settings = settings
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=settings.max_connections,
                limit_per_host=settings.max_in_flight,
                keepalive_timeout=settings.keepalive_s,
            ),
            # No total deadline (a long generation is fine); connect and each read are bounded.
            # Waiting for a free pooled connection is not bounded: the pool is the throttle.
            timeout=aiohttp.ClientTimeout(total=None, connect=None,
                                          sock_connect=settings.connect_timeout_s,
                                          sock_read=settings.read_timeout_s),
            auto_decompress=False,
        )

        # A rollout's answer comes whole when its generation ends, so a POST's read bound is
        # one deadline on its answer: one timer per request, where the session's socket-read
        # bound re-arms a timer on every chunk read (control and metrics GETs keep that one).
        self._answer_timeout = {"timeout": self._deadline(settings.read_timeout_s)}
        self._deadlines: dict[float, dict] = {}

    def _deadline(self, timeout_s: float):
        return self._aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=min(timeout_s, self._settings.connect_timeout_s))

    def _timeout(self, timeout_s: float | None) -> dict:
        if timeout_s is None:
            return {}  # the session's own timeouts
        bound = self._deadlines.get(timeout_s)
        if bound is None:  # few distinct bounds (one per token budget): built once each
            if len(self._deadlines) >= 4096:
                self._deadlines.clear()
            bound = self._deadlines[timeout_s] = {"timeout": self._deadline(timeout_s)}
        return bound

    async def post_json(self, url, payload, headers, timeout_s=None) -> RawAnswer:
        timeout = self._answer_timeout if timeout_s is None else self._timeout(timeout_s)
        try:
            async with self.session.post(url, data=payload, headers=headers, **timeout) as response:
                body = await response.read()
                return RawAnswer(response.status, body, response.headers.get("Retry-After"))
        except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise TransportError(f"POST {url}: {type(exc).__name__}: {exc}") from exc

    async def get(self, url, timeout_s=None) -> RawAnswer:
        try:
            async with self.session.get(url, **self._timeout(timeout_s)) as response:
                return RawAnswer(response.status, await response.read(),
                                 response.headers.get("Retry-After"))
        except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise TransportError(f"GET {url}: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self.session.close()


class HttpxLoopClient(LoopClient):
    """httpx's AsyncClient, on its default transport or on httpx-aiohttp's transport."""

    def __init__(self, settings: HttpSettings) -> None:
        import httpx

        self._httpx = httpx
        self._aiohttp_session = None
        limits = httpx.Limits(max_connections=settings.max_connections,
                              max_keepalive_connections=settings.max_connections,
                              keepalive_expiry=settings.keepalive_s)
        timeout = httpx.Timeout(connect=settings.connect_timeout_s, read=settings.read_timeout_s,
                                write=settings.read_timeout_s, pool=None)
        transport = None
        if settings.client is ClientKind.HTTPX_AIOHTTP:
            from httpx_aiohttp import AiohttpTransport

            self._aiohttp_session = AiohttpLoopClient(settings)
            transport = AiohttpTransport(limits=limits, client=self._aiohttp_session.session)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport)

    def _timeout(self, timeout_s: float | None):
        if timeout_s is None:
            return self._httpx.USE_CLIENT_DEFAULT
        return self._httpx.Timeout(timeout_s)

    async def post_json(self, url, payload, headers, timeout_s=None) -> RawAnswer:
        try:
            response = await self.client.post(url, content=payload, headers=headers,
                                              timeout=self._timeout(timeout_s))
        except self._httpx.TransportError as exc:
            raise TransportError(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        return RawAnswer(response.status_code, response.content, response.headers.get("retry-after"))

    async def get(self, url, timeout_s=None) -> RawAnswer:
        try:
            response = await self.client.get(url, timeout=self._timeout(timeout_s))
        except self._httpx.TransportError as exc:
            raise TransportError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        return RawAnswer(response.status_code, response.content, response.headers.get("retry-after"))

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._aiohttp_session is not None:
            await self._aiohttp_session.aclose()


def make_loop_client(settings: HttpSettings) -> LoopClient:
    if settings.client is ClientKind.AIOHTTP:
        return AiohttpLoopClient(settings)
    return HttpxLoopClient(settings)


class LoopClients:
    """The pooled client of each running event loop, created on first use in that loop."""

    def __init__(self, settings: HttpSettings) -> None:
        self._start_empty(settings)

    def _start_empty(self, settings: HttpSettings) -> None:
        """No client yet: each loop makes its own on first use."""
        self.settings = settings
        self._clients: dict[asyncio.AbstractEventLoop, LoopClient] = {}
        self._keepers: dict[asyncio.AbstractEventLoop, Any] = {}
        self._lock = threading.Lock()

    def current(self) -> LoopClient:
        """The running loop's client (call from inside a coroutine)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._create(loop)
        return client

    def _create(self, loop: asyncio.AbstractEventLoop) -> LoopClient:
        with self._lock:
            for dead in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[dead]
                self._keepers.pop(dead, None)
            client = self._clients.get(loop)
            if client is None:
                client = make_loop_client(self.settings)
                self._clients[loop] = client
                self._keepers[loop] = _close_with_the_loop(client)
            return client

    @property
    def loops_with_a_client(self) -> int:
        return sum(1 for loop in self._clients if not loop.is_closed())

    async def aclose(self) -> None:
        """Close the running loop's client now; ask other live loops to close theirs."""
        running = asyncio.get_running_loop()
        with self._lock:
            clients, self._clients = self._clients, {}
            keepers, self._keepers = self._keepers, {}
        for loop, client in clients.items():
            keeper = keepers.get(loop)
            if loop is running:
                await (keeper.aclose() if keeper is not None else client.aclose())
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(
                    keeper.aclose() if keeper is not None else client.aclose(), loop)

    def __getstate__(self) -> dict:  # a copy builds its own clients where it runs
        return {"settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self._start_empty(state["settings"])


def _close_with_the_loop(client: LoopClient):
    """An async generator, parked at its first yield, whose ``finally`` closes ``client``.

    The loop tracks the async generators started on it and closes them when it shuts down
    (``asyncio.run`` calls ``loop.shutdown_asyncgens()``), so a pool opened inside a short-lived
    ``asyncio.run(...)`` closes its sockets with that loop instead of leaking them. The caller
    keeps a strong reference: the loop's own reference is weak.
    """
    async def keeper():
        try:
            yield
        finally:
            await client.aclose()

    generator = keeper()
    step = generator.__anext__()  # registers the generator with the running loop
    try:
        step.send(None)  # runs up to the first yield, synchronously (nothing is awaited before it)
    except StopIteration:
        pass
    return generator
