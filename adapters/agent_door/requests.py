"""What the agent door reads from a request: its JSON body, the trajectory it names, what it
asks of the answer's tokens, and its messages with the exact tokens known of earlier turns."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
from aiohttp import web

from rollout_fleet.core.agent_turns import (
    REQUIRED_PREFIX_FIELD, TOKEN_FIELDS, RecordedTurn, TurnTokens, recorded_turn_applies,
    token_fields, with_required_prefix,
)
from rollout_fleet.core.errors import InvalidValue

TRAJECTORY_HEADER = "X-Trajectory-Id"
TRAJECTORY_FIELD = "trajectory"  # the body's spelling, for clients that cannot set headers
# What a client may send back on an assistant message that is the door's (or NeMo-Gym's)
# record of the turn, not the conversation: taken out before the template and the frontend.
TURN_RECORD_FIELDS = (*TOKEN_FIELDS, "weight_version", "weight_versions", "routed_experts")


async def json_body(request: web.Request) -> dict[str, Any]:
    return parsed_json(await request.read())


def parsed_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidValue("body", "(not JSON)", f"must be a JSON object: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidValue("body", type(body).__name__, "must be a JSON object")
    return body


def trajectory_name(request: web.Request, body: dict[str, Any]) -> str | None:
    name = body.pop(TRAJECTORY_FIELD, None)
    name = request.headers.get(TRAJECTORY_HEADER) or name
    if name is not None and (not isinstance(name, str) or not name or len(name) > 256):
        raise InvalidValue(TRAJECTORY_FIELD, name, "must be a non-empty string (<= 256 chars)")
    return name


@attrs.frozen
class TokenWishes:
    """What a request asks of the answer's tokens, in vLLM's fields."""

    ids: bool  # return_token_ids: the prompt's and the generated IDs
    logprobs: bool  # logprobs: one per generated token
    as_token_ids: bool  # return_tokens_as_token_ids: each logprob entry's token as token_id:<ID>


def token_wishes(body: dict[str, Any]) -> TokenWishes:
    """The request's token fields, taken out of ``body`` (the door answers them itself)."""
    wants_ids = _flag(body, "return_token_ids")
    as_token_ids = _flag(body, "return_tokens_as_token_ids")
    if as_token_ids and body.get("stream"):
        raise InvalidValue("return_tokens_as_token_ids", True, "is served unstreamed (a "
                           "streamed chat turn carries its IDs in its last chunk)")
    # How many alternatives per token: chat's top_logprobs, a completion's logprobs.
    top_field = "top_logprobs" if "messages" in body else "logprobs"
    top = body.get(top_field)
    if as_token_ids and top not in (None, 0, True, False):
        raise InvalidValue(top_field, top, "must be 0 with return_tokens_as_token_ids (the "
                           "sampled token's ID and logprob; alternatives are not named by ID)")
    return TokenWishes(wants_ids, bool(body.get("logprobs")), as_token_ids)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.pop(name, None)
    if value not in (None, True, False):
        raise InvalidValue(name, value, "must be true or false")
    return bool(value)


def known_turns(body: dict[str, Any]) -> tuple[list[dict], list[str], dict[int, TurnTokens]]:
    """The messages without their turn records, their roles, and the exact tokens known of
    earlier turns: those the messages carry, and NeMo-RL's ``required_prefix_token_ids``."""
    messages, roles, known = split_messages(body)
    required = body.pop(REQUIRED_PREFIX_FIELD, None)
    return messages, roles, with_required_prefix(known, roles, required)


def with_latest_turn(latest: RecordedTurn | None, known: dict[int, TurnTokens],
                      roles: list[str]) -> dict[int, TurnTokens]:
    """A named trajectory's last turn, where the request itself carries no earlier tokens."""
    if latest is None or known:
        return known
    return {recorded_turn_applies(latest, roles, "messages"): latest.tokens}


def split_messages(body: Mapping[str, Any]) -> tuple[list[dict], list[str], dict[int, TurnTokens]]:
    """The messages without their token fields, their roles, and the tokens they carried."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidValue("messages", messages, "must be a non-empty list of messages")
    plain, roles, known = [], [], {}
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidValue(f"messages[{index}]", message, "must be an object with a role")
        try:
            tokens = token_fields(message)
        except InvalidValue as exc:
            raise InvalidValue(f"messages[{index}].{exc.field}", exc.value, exc.rule) from None
        if message["role"] == "assistant":
            check_tool_calls(index, message.get("tool_calls"))
        if tokens is not None:
            if message["role"] != "assistant":
                raise InvalidValue(f"messages[{index}].generation_token_ids", "(set)",
                                   "only an assistant message carries the model's tokens")
            known[index] = tokens
        plain.append({k: v for k, v in message.items() if k not in TURN_RECORD_FIELDS})
        roles.append(message["role"])
    return plain, roles, known


def check_tool_calls(index: int, calls: Any) -> None:
    """An assistant message's tool calls, as a chat template reads them: each a function with
    a name and JSON arguments (vLLM refuses what does not parse, and so does the door)."""
    if calls is None:
        return
    field = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidValue(field, calls, "must be a list of tool calls")
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidValue(f"{field}[{number}]", call,
                               "must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                               "\"arguments\": ...}}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise InvalidValue(f"{field}[{number}].function.arguments", arguments,
                                   f"must be JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise InvalidValue(f"{field}[{number}].function.arguments", arguments,
                               "must be a JSON object")
