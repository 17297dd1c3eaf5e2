"""A private event loop in a daemon thread, for synchronous code that drives async parts.

Engines such as vLLM's async engine are bound to the loop they started on: a fresh
``asyncio.run`` per call (per test, per driver method) would strand them. One loop, started on
first use, serves them all: the NeMo-RL driver's synchronous methods (adapters/nemo_rl) and
the ports' contract suites run their coroutines here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Started on first use; ``close`` stops it (safe to repeat). ``timeout_s``: how long
    ``run`` waits unless told otherwise (None: as long as the coroutine takes)."""

    def __init__(self, name: str = "contract-loop", *, timeout_s: float | None = 300.0) -> None:
        self._name = name
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name=self._name,
                                                daemon=True)
                self._thread.start()
            return self._loop

    @property
    def started(self) -> bool:
        return self._loop is not None

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (``timeout_s``, else the loop's)."""
        loop = self.loop
        if _running_loop() is loop:
            coro.close()
            raise RuntimeError("a synchronous call was made from the loop it runs on")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(
            self._timeout_s if timeout_s is None else timeout_s)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
