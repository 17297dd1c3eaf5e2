"""What the installed Dynamo offers a chat model: its tool-call and reasoning parser names
(the lists its own command line takes its choices from, ``dynamo._core``), and the check of a
fleet's chat settings against them before any process starts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout_fleet.core.errors import InvalidValue

CHAT_KEYS = ("tool_call_parser", "reasoning_parser", "custom_jinja_template")


def offered_parsers() -> dict[str, tuple[str, ...]]:
    """Setting name -> the parser names this Dynamo registers, sorted."""
    from dynamo._core import get_reasoning_parser_names, get_tool_parser_names

    return {"tool_call_parser": tuple(sorted(get_tool_parser_names())),
            "reasoning_parser": tuple(sorted(get_reasoning_parser_names()))}


def check_chat_settings(chat: Mapping[str, Any], field_prefix: str = "chat") -> dict[str, str]:
    """The chat settings that are set, each checked: a parser Dynamo offers, a template file
    that can be read. InvalidValue names the field (``chat.tool_call_parser``) and the value."""
    checked: dict[str, str] = {}
    for key, value in chat.items():
        if key not in CHAT_KEYS:
            raise InvalidValue(f"{field_prefix}.{key}", value,
                               f"unknown key; the chat settings are {', '.join(CHAT_KEYS)}")
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise InvalidValue(f"{field_prefix}.{key}", value, "must be a non-empty string")
        checked[key] = value
    offered = offered_parsers() if set(checked) & {"tool_call_parser", "reasoning_parser"} else {}
    for key, names in offered.items():
        if key in checked and checked[key] not in names:
            raise InvalidValue(f"{field_prefix}.{key}", checked[key],
                               f"not a parser this Dynamo offers ({', '.join(names)})")
    template = checked.get("custom_jinja_template")
    if template is not None:
        path = Path(template).expanduser()
        if not path.is_file():
            raise InvalidValue(f"{field_prefix}.custom_jinja_template", template,
                               "is not a readable file (a Jinja chat template)")
        checked["custom_jinja_template"] = str(path.resolve())
    return checked
