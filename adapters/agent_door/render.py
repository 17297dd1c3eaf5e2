"""Rendering and tokenizing off the door's event loop: a long chat template or a long prompt
holds a thread of this pool, never the loop that answers every other request of the process.
Each thread works on its own copy of the chat template (a tokenizer may not be safe to share
between threads that call it at once). The template's tokenizer is loaded in a thread of the
pool too, by the first request that needs it."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rollout_fleet.adapters.agent_door.template import ChatTemplate

_Result = TypeVar("_Result")


class Renderer:
    def __init__(self, template: ChatTemplate, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"render threads must be >= 1, got {threads}")
        self.template = template  # the loop's own: for what is cheap (names, sizes)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="door-render")
        self._local = threading.local()

    async def run(self, work: Callable[[ChatTemplate], _Result]) -> _Result:
        """``work(template)`` in a thread of the pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._in_thread, work)

    async def vocab_size(self) -> int:
        """The tokenizer's vocabulary size, its tokenizer loaded first off the loop."""
        if not self.template.loaded:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.template.load)
        return self.template.vocab_size

    def _in_thread(self, work: Callable[[ChatTemplate], _Result]) -> _Result:
        template = getattr(self._local, "template", None)
        if template is None:
            template = self._local.template = copy.deepcopy(self.template)
        return work(template)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
