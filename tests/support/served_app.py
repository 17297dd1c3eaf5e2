"""An aiohttp application served on loopback by an event loop of its own thread: a stand-in
frontend, or a door in the test's own process (``thread_door``) where a test needs one over
another model folder or template than its fleet's (the fleet's own door is ``fleet.door``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from rollout_fleet.adapters.agent_door.app import door_app
from rollout_fleet.adapters.agent_door.hop import HopSettings
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.core.agent_turns import Trajectories


class Served:
    """A server on an event loop of its own thread; ``url`` has no path."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def thread_door(frontend_url: str, model: str | Path, served_model_name: str,
                chat: Mapping[str, str] | None = None, *, max_model_len: int,
                hop: HopSettings | None = None) -> Served:
    """A door over ``frontend_url`` for ``model`` (its tokenizer loaded at the first request
    that needs it, as in a door process), trajectories in memory."""
    template = ChatTemplate(str(model), served_model_name,
                            (chat or {}).get("custom_jinja_template"), load_now=False)
    return Served(door_app(frontend_url, template, Trajectories(), max_model_len=max_model_len,
                           hop=hop))
