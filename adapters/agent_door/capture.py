"""One door process's side of token capture: its staging, attached lazily when it first sees a
setup (a process that never serves a captured call never joins the trainer's Ray cluster),
the blocking capture work run in a pool of its own off the event loop, the captured calls
it has in flight (``LiveCalls``: what a generation cut reads) and its side of a checkpoint's
generation fence (``fence.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import attrs

from rollout_fleet.adapters.agent_door.door_state import CaptureSettings, SharedState
from rollout_fleet.adapters.agent_door.fence import CheckpointFence
from rollout_fleet.core.capture_records import StagingUnavailable
from rollout_fleet.core.cut_prefix import CutProgress
from rollout_fleet.core.sampling_guard import SamplingProfiles
from rollout_fleet.core.token_capture import CaptureCall, TokenStaging

_Result = TypeVar("_Result")
# Blocking, may take seconds (joining a Ray cluster); StagingUnavailable when it cannot.
StagingFactory = Callable[[CaptureSettings], TokenStaging]
CAPTURE_THREADS = 4


@attrs.define(eq=False)
class LiveCall:
    """A captured call this process is decoding: its admission, its prompt as the engine sees
    it (before any restored prefix), its generation so far and its cuts."""

    call: CaptureCall
    prompt: tuple[int, ...]
    effective_output_limit: int
    progress: CutProgress
    cut_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)


class LiveCalls:
    """The captured calls in flight in this process, by ``model_call_id``."""

    def __init__(self) -> None:
        self._calls: dict[str, LiveCall] = {}

    def add(self, live: LiveCall) -> None:
        self._calls[live.call.admission.model_call_id] = live

    def remove(self, live: LiveCall) -> None:
        if self._calls.get(live.call.admission.model_call_id) is live:
            del self._calls[live.call.admission.model_call_id]

    def get(self, model_call_id: str) -> LiveCall | None:
        return self._calls.get(model_call_id)

    def __len__(self) -> int:
        return len(self._calls)


class DoorCapture:
    """Token capture in one door process: ``shared`` holds the setup, ``staging_factory``
    builds the staging of a setup (None: this door stages nothing, and says so);
    ``sampling``: the door's own profiles, where no setup gives them."""

    def __init__(self, shared: SharedState | None, staging_factory: StagingFactory | None,
                 sampling: SamplingProfiles | None = None) -> None:
        self.shared = shared
        self._factory = staging_factory
        self._sampling = sampling
        self._pool = ThreadPoolExecutor(CAPTURE_THREADS, thread_name_prefix="door-capture")
        self._staging: tuple[int, TokenStaging] | None = None
        self._attaching = asyncio.Lock()
        self.live = LiveCalls()
        self.fence = CheckpointFence(shared)

    async def settings(self) -> tuple[CaptureSettings | None, int]:
        """The setup in force and the rollout weight version, read now."""
        if self.shared is None:
            return None, 0
        snapshot = await self.shared.snapshot()
        return snapshot.capture, snapshot.weight_version

    def sampling(self, settings: CaptureSettings | None) -> SamplingProfiles | None:
        return settings.sampling if settings and settings.sampling else self._sampling

    async def staging(self, settings: CaptureSettings) -> TokenStaging:
        """The staging of ``settings``, built the first time this process sees that setup."""
        async with self._attaching:
            if self._staging is None or self._staging[0] != settings.setup:
                if self._factory is None:
                    raise StagingUnavailable("this door was started without token staging")
                staging = await self.run(self._factory, settings)
                self._staging = (settings.setup, staging)
            return self._staging[1]

    async def run(self, call: Callable[..., _Result], *args: Any) -> _Result:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
