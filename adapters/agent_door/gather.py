"""A chat turn read from the frontend's event stream and answered whole (``GatheredTurn``):
what a captured call whose generation may be cut does, so the door holds its tokens as they
come while its client still gets one answer.

Each chunk carries its generated token IDs (Dynamo's ``nvext.completion_token_ids``) and
their logprobs (``choices[0].logprobs.content``), handed to ``on_tokens`` in order; the
message's content, reasoning and tool calls are joined as the frontend would join them
unstreamed; the last chunk's ``engine_data`` (every generated ID, hidden stop tokens too)
stays in ``nvext`` for the door to read as from an unstreamed answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rollout_fleet.core.errors import RolloutFleetError

TokensSeen = Callable[[list[int], list[float]], None]
TOKEN_IDS_FIELD = "completion_token_ids"  # Dynamo's per-chunk generated IDs (an extra field)
_TEXT_FIELDS = ("content", "reasoning_content")


class StreamBroken(RolloutFleetError):
    """The frontend's stream ended in an error event, or without its last chunk."""


class GatheredTurn:
    def __init__(self, on_tokens: TokensSeen) -> None:
        self._on_tokens = on_tokens
        self._answer: dict[str, Any] | None = None
        self._message: dict[str, Any] = {"role": "assistant", "content": None}
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._nvext: dict[str, Any] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").strip()
        if not text.startswith("data:") or text[5:].strip() == "[DONE]":
            return
        try:
            chunk = json.loads(text[5:])
        except ValueError as exc:
            raise StreamBroken(f"the frontend sent an unreadable event: {exc}") from None
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            raise StreamBroken(f"the frontend's stream failed: {chunk['error']}")
        self._chunk(chunk)

    def _chunk(self, chunk: dict[str, Any]) -> None:
        if self._answer is None:
            self._answer = {name: chunk.get(name) for name in ("id", "created", "model")}
        nvext = chunk.get("nvext") or {}
        choices = [c for c in chunk.get("choices") or [] if isinstance(c, dict)]
        if choices:
            choice = choices[0]
            self._finish = choice.get("finish_reason") or self._finish
            self._delta(choice.get("delta") or {})
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            seen = nvext.get(TOKEN_IDS_FIELD)
            if seen:
                self._on_tokens(list(seen), [entry.get("logprob") for entry in logprobs])
        for name, value in nvext.items():
            if name != TOKEN_IDS_FIELD:
                self._nvext[name] = value
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]

    def _delta(self, delta: dict[str, Any]) -> None:
        for name in _TEXT_FIELDS:
            if isinstance(delta.get(name), str):
                self._message[name] = (self._message.get(name) or "") + delta[name]
        for call in delta.get("tool_calls") or []:
            whole = self._tool_calls.setdefault(call.get("index", len(self._tool_calls)), {
                "id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            whole["id"] = call.get("id") or whole["id"]
            whole["type"] = call.get("type") or whole["type"]
            function = call.get("function") or {}
            if function.get("name"):
                whole["function"]["name"] = function["name"]
            whole["function"]["arguments"] += function.get("arguments") or ""

    def answer(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The whole answer, as the frontend writes an unstreamed one."""
        if self._answer is None or self._finish is None:
            raise StreamBroken("the frontend's stream ended before its last chunk")
        message = dict(self._message)
        if self._tool_calls:
            message["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        usage = self._usage or {"prompt_tokens": prompt_tokens,
                                "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens}
        answer = {**self._answer, "object": "chat.completion", "usage": usage,
                  "choices": [{"index": 0, "message": message, "finish_reason": self._finish,
                               "logprobs": None}]}
        if self._nvext:
            answer["nvext"] = dict(self._nvext)
        return answer
