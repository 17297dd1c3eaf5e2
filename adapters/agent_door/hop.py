"""The door's hop to the fleet's Dynamo frontend: one pooled aiohttp session per door process,
a connect deadline and a read deadline (between two reads of an answer), and the driver's
retry rules (``core.retry``): a transport error or an HTTP 408/429/499/5xx is sent again, after
the policy's backoff, up to its attempts. A request pinned to a worker (Dynamo's
``backend_instance_id``: the worker that holds its prefix) that this worker cannot serve is sent
once more at once, unpinned: whichever worker the router picks recomputes the prefix.

A streamed answer is retried only until it opens (its status): once its first byte went to the
client, nothing is sent again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
import attrs

from rollout_fleet.core.errors import HttpStatusError, RolloutFleetError, TransportError
from rollout_fleet.core.retry import RetryPolicy, is_transient_status
from rollout_fleet.core.validate import finite_at_least

logger = logging.getLogger(__name__)
_Answer = TypeVar("_Answer")
# Headers of a request the frontend reads too (the driver's request id names every attempt).
PASSED_HEADERS = ("x-request-id",)


@attrs.frozen
class HopSettings:
    connect_s: float = attrs.field(default=10.0,
                                   validator=finite_at_least("door.connect_s", strictly=True))
    # An unstreamed answer comes when its whole generation is done: minutes, not seconds.
    read_s: float = attrs.field(default=600.0,
                                validator=finite_at_least("door.read_s", strictly=True))
    retry: RetryPolicy = RetryPolicy()


class FrontendUnreachable(RolloutFleetError):
    """Every attempt failed without an HTTP answer (the door answers 502, or 504 on a read
    deadline)."""

    def __init__(self, url: str, attempts: int, cause: BaseException) -> None:
        self.timed_out = isinstance(cause, asyncio.TimeoutError)
        what = "no answer within the read deadline" if self.timed_out else \
            f"{type(cause).__name__}: {cause}"
        super().__init__(f"the fleet's frontend at {url} did not answer after {attempts} "
                         f"attempt(s): {what}")


@attrs.frozen
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return {"error": {"message": self.body.decode("utf-8", "replace"),
                              "code": self.status}}


class FrontendHop:
    def __init__(self, frontend_url: str, settings: HopSettings | None = None) -> None:
        self.frontend_url = frontend_url.rstrip("/")
        self.settings = settings or HopSettings()
        self._session: aiohttp.ClientSession | None = None
        self._random = random.Random()

    async def post(self, path: str, body: Mapping[str, Any] | bytes, *,
                   pinned: int | None = None,
                   headers: Mapping[str, str] | None = None) -> Answer:
        """``body`` (JSON, or bytes sent as they are) to ``path``, answered whole."""
        async def send(sent: bytes) -> Answer:
            async with self._client().post(self._url(path), data=sent,
                                           headers=_json_headers(headers)) as answer:
                return Answer(answer.status, await answer.read())

        return await self._attempts(path, body, pinned, send, lambda answer: answer.status,
                                    _no_release)

    async def get(self, path: str) -> Answer:
        async def send(_sent: bytes) -> Answer:
            async with self._client().get(self._url(path)) as answer:
                return Answer(answer.status, await answer.read())

        return await self._attempts(path, b"", None, send, lambda answer: answer.status,
                                    _no_release)

    async def open_stream(self, path: str, body: Mapping[str, Any], *,
                          pinned: int | None = None) -> aiohttp.ClientResponse:
        """A streamed answer, opened: status 200 to be read on, or the status that ended the
        attempts (the caller reads and releases it)."""
        async def send(sent: bytes) -> aiohttp.ClientResponse:
            return await self._client().post(self._url(path), data=sent,
                                             headers=_json_headers(None))

        return await self._attempts(path, body, pinned, send, lambda answer: answer.status,
                                    lambda answer: answer.release())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _attempts(self, path: str, body: Mapping[str, Any] | bytes, pinned: int | None,
                        send: Callable[[bytes], Awaitable[_Answer]],
                        status_of: Callable[[_Answer], int],
                        release: Callable[[_Answer], None]) -> _Answer:
        attempt, pin = 0, pinned
        while True:
            attempt += 1
            error: RolloutFleetError
            try:
                answer = await send(_encoded(body, pin))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if not self.settings.retry.should_retry(attempt, TransportError(str(exc))):
                    raise FrontendUnreachable(self._url(path), attempt, exc) from exc
                error = TransportError(str(exc))
            else:
                status = status_of(answer)
                if pin is not None and _worker_could_not_serve(status):
                    logger.info("worker %s did not serve a pinned request (%s); routing it "
                                "afresh", pin, status)
                    release(answer)
                    attempt, pin = attempt - 1, None  # not the request's fault: sent again now
                    continue
                error = HttpStatusError(status)
                if not is_transient_status(status) or \
                        not self.settings.retry.should_retry(attempt, error):
                    return answer
                release(answer)
            logger.info("attempt %d to %s failed (%s); sending it again", attempt, path, error)
            await asyncio.sleep(self.settings.retry.delay_s(attempt, self._random.random()))

    def _url(self, path: str) -> str:
        return f"{self.frontend_url}{path}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_s,
                                            sock_read=self.settings.read_s)
            self._session = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self._session


def _encoded(body: Mapping[str, Any] | bytes, pin: int | None) -> bytes:
    if isinstance(body, bytes):
        return body
    if pin is not None:
        body = {**body, "nvext": {**(body.get("nvext") or {}), "backend_instance_id": pin}}
    return json.dumps(body).encode()


def _json_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    passed = {k: v for k, v in (headers or {}).items() if k.lower() in PASSED_HEADERS}
    return {"Content-Type": "application/json", **passed}


def _no_release(_answer: Answer) -> None:
    pass


def _worker_could_not_serve(status: int) -> bool:
    """A pinned request's answer that sends it to another worker (gone, overloaded, failing)."""
    return status in (404, 408, 429) or status >= 500
