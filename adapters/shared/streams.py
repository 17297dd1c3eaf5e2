"""Async streams handed across a port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any


@contextlib.asynccontextmanager
async def closed_on_exit(stream: AsyncIterator[Any]) -> AsyncGenerator[None, None]:
    """``contextlib.aclosing`` for a stream that a port promises only as an async iterator:
    closed on leaving when it can be (an async generator, whose work then ends with it)."""
    try:
        yield
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
