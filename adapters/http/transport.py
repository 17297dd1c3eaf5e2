"""The completions transport over one pooled HTTP client per event loop.

Its answers are decoded straight into their typed value: msgspec reads only the fields the
driver uses (``nvext.engine_data``, and whether the body says it failed), checking each
element's type and range as it decodes, where ``json.loads`` would build every object of the
body first and the value classes would check each element again. An answer it does not read as
a served rollout goes to the core's ``parse_completion_answer``, which raises the error that
names what is wrong: the values read and the errors raised are the core's, only the common case
is faster.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from rollout_fleet.adapters.http.pool import JSON_CONTENT_TYPE, LoopClients, dumps
from rollout_fleet.adapters.http.settings import HttpSettings
from rollout_fleet.core.errors import InvalidValue, TransportError
from rollout_fleet.core.rollout import FinishReason, ServedRollout
from rollout_fleet.core.wire import (
    ENGINE_DATA_VERSION,
    REQUEST_ID_HEADER,
    parse_completion_answer,
)
from rollout_fleet.ports.completions import CompletionsTransport, TransportResponse

COMPLETIONS_PATH = "/v1/completions"


def check_base_url(field: str, url: Any) -> str:
    """An ``http://host:port`` URL without a trailing slash; refuses anything else by name."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) \
            or len(url.rstrip("/")) <= len("https://"):
        raise InvalidValue(field, url, "must be an http:// or https:// URL such as http://127.0.0.1:8000")
    return url.rstrip("/")


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None or when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class HttpCompletionsTransport(CompletionsTransport):
    """POSTs rollout bodies to the frontend's ``/v1/completions``.

    Every attempt carries the rollout's request id in the ``x-request-id`` header, so the
    frontend's logs (and a test's server) can tell a retry from new work.
    """

    def __init__(self, frontend_url: str, settings: HttpSettings | None = None, *,
                 clients: LoopClients | None = None) -> None:
        self.frontend_url = check_base_url("frontend_url", frontend_url)
        self.url = self.frontend_url + COMPLETIONS_PATH
        self.clients = clients or LoopClients(settings or HttpSettings())
        self.settings = self.clients.settings
        self._attempt_timeout = self.settings.attempt_timeout()

    async def post_completion(self, body: Mapping[str, Any], *, request_id: str) -> TransportResponse:
        answer = await self.clients.current().post_json(
            self.url, dumps(body),
            {"content-type": JSON_CONTENT_TYPE, REQUEST_ID_HEADER: request_id},
            timeout_s=self._timeout_s(body))
        if answer.status == 404 and not answer.body.strip():
            # Dynamo's frontend mounts /v1/completions only once it has discovered a model: a
            # frontend that (re)started answers a bare 404 for a moment (an unknown model gets a
            # JSON body). Retry it like a frontend that is not listening yet.
            raise TransportError(f"POST {self.url}: HTTP 404 with no body: the frontend has no "
                                 "completions route yet (starting up, no model discovered)")
        retry_after = None if answer.retry_after is None else parse_retry_after(answer.retry_after)
        return TransportResponse(answer.status, answer.body, retry_after)

    def read_answer(self, body: bytes) -> ServedRollout:
        return read_completion_answer(body)

    def _timeout_s(self, body: Mapping[str, Any]) -> float | None:
        """This attempt's bound: from the body's token budget when the settings give one."""
        bound = self._attempt_timeout
        if bound is None:
            return self.settings.request_timeout_s
        tokens = body.get("max_tokens")
        if type(tokens) is not int:  # no budget to go by: the whole request bound
            return self.settings.request_timeout_s
        return bound.bound_s(tokens)

    async def aclose(self) -> None:
        await self.clients.aclose()

    def __repr__(self) -> str:
        return f"HttpCompletionsTransport({self.url!r}, client={self.settings.client.value!r})"


# -- the answer, decoded straight into its typed value ----------------------------------------
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Logprob = Annotated[float, msgspec.Meta(le=0.0)]  # JSON has no NaN; out of range is refused
Count = Annotated[int, msgspec.Meta(ge=0)]
VersionRun = tuple[Count, Annotated[int, msgspec.Meta(ge=1)]]


class EngineData(msgspec.Struct):
    """``core.wire.engine_data_of``'s fields; a refusal (``refused``) is left to the core."""

    v: Literal[ENGINE_DATA_VERSION]  # type: ignore[valid-type]
    token_ids: tuple[TokenId, ...]
    logprobs: tuple[Logprob, ...] | None  # None: the rollout asked for none
    finish_reason: FinishReason
    prompt_tokens: Count
    routed_experts: Any = None
    weight_version: Count | None = None
    weight_versions: tuple[VersionRun, ...] | None = None
    refused: Any = msgspec.UNSET


class Nvext(msgspec.Struct):
    engine_data: EngineData


class CompletionAnswer(msgspec.Struct):
    """The answer's fields the driver reads; the rest of the body is skipped unbuilt."""

    nvext: Nvext | None = None
    status: Any = None
    error: Any = msgspec.UNSET


decode_answer = msgspec.json.Decoder(CompletionAnswer).decode


def read_completion_answer(body: bytes) -> ServedRollout:
    """``core.wire.parse_completion_answer(body)``: the same value or the same error."""
    served = served_or_none(body)
    return parse_completion_answer(body) if served is None else served


def served_or_none(body: bytes) -> ServedRollout | None:
    """The served rollout of a well-formed answer; None for anything else (an error in the
    body, a refusal, a missing field, a value out of range), which the core then names."""
    try:
        answer = decode_answer(body)
    except (msgspec.DecodeError, TypeError):  # a ValidationError is a DecodeError
        return None
    if answer.error is not msgspec.UNSET or answer.status == "error" or answer.nvext is None:
        return None
    data = answer.nvext.engine_data
    if data.refused is not msgspec.UNSET or (
            data.logprobs is not None and len(data.token_ids) != len(data.logprobs)):
        return None
    try:  # each element was checked as it was decoded: only the checks across fields remain
        return ServedRollout.from_decoded(
            data.token_ids, data.logprobs, data.finish_reason, data.prompt_tokens,
            routed_experts=data.routed_experts, weight_version=data.weight_version,
            weight_versions=data.weight_versions)
    except InvalidValue:  # runs that do not tag every token once
        return None
