"""A door process's siblings: the other processes of the same door, each serving a small
application on a Unix socket of its own in the door's folder (``cut-<pid>.sock``). What one
process is asked for the whole door (a generation cut, a checkpoint fence's drain) it asks
each sibling over its socket and joins the answers; a sibling that does not answer in time is
left out (its log says why), never waited on past the deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)
SOCKET_GLOB = "cut-*.sock"


def sibling_socket(folder: Path, pid: int) -> Path:
    return folder / f"cut-{pid}.sock"


class Siblings:
    """The siblings of the process whose socket is ``own`` in ``folder`` (None: a door of one
    process, no siblings)."""

    def __init__(self, folder: Path | None, own: Path | None) -> None:
        self._folder, self._own = folder, own

    def sockets(self) -> list[Path]:
        if self._folder is None:
            return []
        return sorted(path for path in self._folder.glob(SOCKET_GLOB) if path != self._own)

    async def ask_all(self, route: str, body: dict[str, Any],
                      deadline: float) -> list[dict[str, Any]]:
        """Each sibling's JSON answer to ``POST route`` (those that answered 200 in time)."""
        answers = await asyncio.gather(*(self._ask(path, route, body, deadline)
                                         for path in self.sockets()))
        return [answer for answer in answers if answer is not None]

    async def _ask(self, path: Path, route: str, body: dict[str, Any],
                   deadline: float) -> dict[str, Any] | None:
        timeout = aiohttp.ClientTimeout(total=max(0.1, deadline - time.monotonic()))
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path)),
                                             timeout=timeout) as session:
                async with session.post(f"http://door{route}", json=body) as answer:
                    held = await answer.json() if answer.status == 200 else None
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.info("sibling %s did not answer %s: %s", path.name, route, exc)
            return None
        return held if isinstance(held, dict) else None
