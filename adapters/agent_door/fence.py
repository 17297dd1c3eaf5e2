"""A checkpoint's generation fence at the door: NeMo-RL's ``pause_generation_for_checkpoint``,
``resume_generation_after_cut``, ``finish_generation_checkpoint`` and
``resume_generation_after_checkpoint``, as door controls.

While NeMo-RL snapshots its data plane, no captured turn may land in staging that the
snapshot could see half of, and the prefixes NeMo-Gym's cuts stage must be those of calls
that stand still at the door. The fence has three phases, kept in the door's shared state so
that every process reads the same (``door_state.py``):

- ``open``: calls are forwarded and finished turns staged as they come;
- ``frozen`` (``pause_generation_for_checkpoint``): a new captured call waits before it is
  forwarded, and a finished turn waits before it is staged, so before it is answered; the
  pause returns once no process of the door is still staging a finished turn;
- ``cut`` (``resume_generation_after_cut``): calls are forwarded again (the cuts staged their
  prefixes; decoding goes on past them), finished turns still wait;
- back to ``open``: ``finish_generation_checkpoint`` or ``resume_generation_after_checkpoint``
  (either one, any number of times: a release after a release changes nothing).

Calls already decoding are never stopped: a cut freezes what they generated so far and their
decoding goes on into a fresh chunk (``cuts.py``), which only a later cut or the call's own
finished turn stages. Each process counts the finished turns it is staging; the process a pause
reaches asks its siblings to drain theirs (``siblings.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from rollout_fleet.adapters.agent_door.door_state import FencePhase, SharedState
from rollout_fleet.adapters.agent_door.requests import parsed_json
from rollout_fleet.adapters.agent_door.siblings import Siblings
from rollout_fleet.core.errors import InvalidValue

DRAIN_ROUTE = "/door/sibling/checkpoint-drain"
POLL_S = 0.02
DEFAULT_TIMEOUT_S = 60.0
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class FenceNotDrained(TimeoutError):
    """A pause whose door processes were still staging finished turns at its deadline."""


class CheckpointFence:
    """One door process's side of the fence: its waits, and the finished turns it is staging
    (counted before the phase is read, so a drain that sees none has none to wait for)."""

    def __init__(self, shared: SharedState | None) -> None:
        self._shared = shared
        self._staging = 0
        self._polled: tuple[float, FencePhase] = (float("-inf"), "open")
        self._polling = asyncio.Lock()

    async def phase(self) -> FencePhase:
        """The phase as the shared state holds it now."""
        if self._shared is None:
            return "open"
        phase: FencePhase = await self._shared.run(self._shared.state.fence_phase)
        self._polled = (time.monotonic(), phase)
        return phase

    async def _recent_phase(self) -> FencePhase:
        """The phase read at most ``POLL_S`` ago: one read however many calls wait."""
        async with self._polling:
            read_at, phase = self._polled
            if time.monotonic() - read_at < POLL_S:
                return phase
            return await self.phase()

    async def _wait_while(self, holding: Callable[[FencePhase], bool]) -> None:
        while holding(await self._recent_phase()):
            await asyncio.sleep(POLL_S)

    async def hold_new_call(self) -> None:
        """Wait while the fence is frozen (before a captured call is forwarded)."""
        await self._wait_while(lambda phase: phase == "frozen")

    @contextlib.asynccontextmanager
    async def terminal_write(self) -> AsyncIterator[None]:
        """Around the staging of a finished turn: entered once the fence is open."""
        while True:
            self._staging += 1
            if await self.phase() == "open":
                break
            self._staging -= 1
            await self._wait_while(lambda phase: phase != "open")
        try:
            yield
        finally:
            self._staging -= 1

    async def drain(self, deadline: float) -> int:
        """Wait until this process stages no finished turn (or ``deadline``); how many it
        still stages."""
        while self._staging and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S / 4)
        return self._staging

    def add_sibling_routes(self, app: web.Application) -> None:
        app.router.add_post(DRAIN_ROUTE, self._sibling_drain)

    async def _sibling_drain(self, request: web.Request) -> web.Response:
        timeout_s = checked_timeout(parsed_json(await request.read()))
        left = await self.drain(time.monotonic() + timeout_s)
        return web.json_response({"pid": os.getpid(), "staging": left})


class CheckpointControls:
    """The four controls (NeMo-RL's names), over ``fence`` and the process's ``siblings``."""

    def __init__(self, shared: SharedState, fence: CheckpointFence, siblings: Siblings) -> None:
        self._shared, self._fence, self._siblings = shared, fence, siblings

    def handlers(self) -> dict[str, Handler]:
        return {"pause_generation_for_checkpoint": self.pause,
                "resume_generation_after_cut": self.resume_after_cut,
                "finish_generation_checkpoint": self.release,
                "resume_generation_after_checkpoint": self.release}

    async def _move(self, to: FencePhase, allowed_from: tuple[FencePhase, ...]
                    ) -> dict[str, Any]:
        was, now = await self._shared.run(self._shared.state.move_fence, to, allowed_from)
        return {"phase": now, "was": was}

    async def pause(self, args: dict[str, Any]) -> dict[str, Any]:
        timeout_s = checked_timeout(args)
        moved = await self._move("frozen", ("open", "frozen", "cut"))
        deadline = time.monotonic() + timeout_s
        asked = self._siblings.sockets()
        here, answers = await asyncio.gather(
            self._fence.drain(deadline),
            self._siblings.ask_all(DRAIN_ROUTE, {"timeout_s": timeout_s}, deadline))
        staging = {os.getpid(): here, **{int(a["pid"]): int(a["staging"]) for a in answers}}
        busy = {pid: left for pid, left in staging.items() if left}
        silent = len(asked) - len(answers)
        if busy or silent:
            raise FenceNotDrained(
                f"the door did not drain within {timeout_s:g} s: finished turns still staging "
                f"{busy or 'nowhere'}, {silent} door process(es) did not answer; the fence "
                "stays frozen until resume_generation_after_checkpoint")
        return {**moved, "door_processes": len(staging)}

    async def resume_after_cut(self, args: dict[str, Any]) -> dict[str, Any]:
        checked_timeout(args)
        return await self._move("cut", ("frozen",))

    async def release(self, args: dict[str, Any]) -> dict[str, Any]:
        checked_timeout(args)
        return await self._move("open", ("frozen", "cut"))


def checked_timeout(args: dict[str, Any]) -> float:
    value = args.get("timeout_s")
    if value is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidValue("timeout_s", value, "must be null or > 0 seconds")
    return float(value)
