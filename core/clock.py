"""The clock the core's services sleep through; tests inject a fake one."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod


class Clock(ABC):
    @abstractmethod
    def monotonic(self) -> float: ...

    @abstractmethod
    async def sleep(self, seconds: float) -> None: ...


class SystemClock(Clock):
    # The system's own function itself: no frame of ours around a clock read.
    monotonic = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
