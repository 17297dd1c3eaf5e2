"""What the agent door writes into the frontend's answers: the worker's ``engine_data`` taken
out, the turn's tokens on the message (NeMo-Gym's fields) and vLLM's ``return_token_ids``
fields, the prefix-cache hit in OpenAI's usage field; and the same for a streamed turn, chunk
by chunk (``TurnStream``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rollout_fleet.core.agent_turns import TurnTokens


def engine_data(answer: dict[str, Any]) -> dict[str, Any]:
    """The worker's ``engine_data``, taken out of the answer (the client did not ask for it)."""
    nvext = answer.get("nvext") or {}
    engine = nvext.pop("engine_data", None) or {}
    if not nvext:
        answer.pop("nvext", None)
    return engine


def turn_tokens(engine: Mapping[str, Any], prompt: list[int]) -> TurnTokens:
    return TurnTokens(prompt, engine.get("token_ids") or (), engine.get("log_probs") or (),
                      engine.get("weight_version"), engine.get("weight_versions") or ())


def _version_fields(tokens: TurnTokens) -> dict[str, Any]:
    return {"weight_version": tokens.weight_version,
            "weight_versions": [list(run) for run in tokens.weight_versions]}


def write_cached_tokens(answer: dict[str, Any], engine: Mapping[str, Any]) -> None:
    """The turn's prefix-cache hit, where the engine told it, in OpenAI's own field: how many
    of the prompt's tokens the serving worker already held."""
    cached = engine.get("cached_prompt_tokens")
    if isinstance(cached, int) and isinstance(answer.get("usage"), dict):
        details = answer["usage"].get("prompt_tokens_details") or {}
        answer["usage"]["prompt_tokens_details"] = {**details, "cached_tokens": cached}


def served_by(answer: dict[str, Any], asked: Mapping[str, Any]) -> int | None:
    """The Dynamo instance that generated the answer; its ``worker_id`` is left in the answer
    only when the client asked for it."""
    nvext = answer.get("nvext") or {}
    asked_fields = (asked.get("nvext") or {}).get("extra_fields") or []
    served = nvext.get("worker_id") if "worker_id" in asked_fields else nvext.pop("worker_id", None)
    if not nvext:
        answer.pop("nvext", None)
    return (served or {}).get("decode_worker_id")


def write_chat_tokens(answer: dict[str, Any], tokens: TurnTokens, *, wants_ids: bool,
                       wants_logprobs: bool) -> None:
    choice = answer["choices"][0]
    choice["message"].update(prompt_token_ids=list(tokens.prompt_token_ids),
                             generation_token_ids=list(tokens.generation_token_ids),
                             generation_log_probs=list(tokens.generation_log_probs),
                             **_version_fields(tokens))
    if wants_ids:
        answer["prompt_token_ids"] = list(tokens.prompt_token_ids)
        choice["token_ids"] = list(tokens.generation_token_ids)
    if not wants_logprobs:
        choice["logprobs"] = None


def write_token_id_logprobs(choice: dict[str, Any], tokens: TurnTokens, *, chat: bool) -> None:
    """vLLM's ``return_tokens_as_token_ids``: each logprob entry names its token as
    ``token_id:<ID>``, written from the turn's exact tokens (a token's text can be ambiguous;
    its ID is not). A completion's entries are rewritten only where it asked for logprobs."""
    names = [f"token_id:{token}" for token in tokens.generation_token_ids]
    if chat:
        choice["logprobs"] = {"content": [
            {"token": name, "logprob": logprob, "bytes": None, "top_logprobs": []}
            for name, logprob in zip(names, tokens.generation_log_probs)], "refusal": None}
        return
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        logprobs["tokens"] = names
        logprobs["token_logprobs"] = list(tokens.generation_log_probs)


class TurnStream:
    """One streamed chat turn relayed to the client: each server-sent event rewritten as the
    whole answer would be (``engine_data`` taken out, token fields written; the prompt's IDs on
    the first chunk and every generated ID on the last, for ``return_token_ids``); the turn's
    tokens and serving worker kept for the trajectory once the stream ends."""

    def __init__(self, prompt: list[int], asked: Mapping[str, Any], *, wants_ids: bool,
                 wants_logprobs: bool) -> None:
        self._prompt, self._asked = prompt, asked
        self._wants_ids, self._wants_logprobs = wants_ids, wants_logprobs
        self._first = True
        self.tokens: TurnTokens | None = None  # once the chunk with the worker's data passed
        self.worker: int | None = None
        self._engine: dict[str, Any] = {}  # the worker's data, once its chunk passed

    def line(self, raw: bytes) -> bytes:
        """One line of the frontend's event stream, as the client gets it."""
        text = raw.decode("utf-8", "replace")
        if not text.startswith("data:") or text[5:].strip() == "[DONE]":
            return raw
        try:
            chunk = json.loads(text[5:])
        except ValueError:
            return raw
        if isinstance(chunk, dict):
            self._rewrite(chunk)
        return f"data: {json.dumps(chunk)}\n".encode()

    def _rewrite(self, chunk: dict[str, Any]) -> None:
        engine = engine_data(chunk)
        worker = served_by(chunk, self._asked)
        self.worker = worker if worker is not None else self.worker
        choices = [c for c in chunk.get("choices") or [] if isinstance(c, dict)]
        if self._wants_ids and self._first:
            chunk["prompt_token_ids"] = list(self._prompt)
        self._first = False
        for choice in choices:
            if self._wants_ids:
                choice["token_ids"] = []
            if not self._wants_logprobs:
                choice["logprobs"] = None
        if engine:
            self.tokens, self._engine = turn_tokens(engine, self._prompt), engine
            for choice in choices:
                _write_delta_tokens(choice, self.tokens, wants_ids=self._wants_ids)
        # The usage (``stream_options.include_usage``) comes in a chunk of its own, after the
        # worker's data: the prefix-cache hit goes there.
        write_cached_tokens(chunk, self._engine)


def _write_delta_tokens(choice: dict[str, Any], tokens: TurnTokens, *, wants_ids: bool) -> None:
    delta = choice.setdefault("delta", {})
    delta.update(prompt_token_ids=list(tokens.prompt_token_ids),
                 generation_token_ids=list(tokens.generation_token_ids),
                 generation_log_probs=list(tokens.generation_log_probs),
                 **_version_fields(tokens))
    if wants_ids:
        choice["token_ids"] = list(tokens.generation_token_ids)
