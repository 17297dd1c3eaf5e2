"""How an adapter names a library's error in one line of its own message."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The error's type and the first line of its text (a library's error may run to pages:
    a traceback from another process, a C++ stack)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else repr(error)
