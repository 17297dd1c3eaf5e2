"""Serve the agent door (adapters/agent_door) for a fleet in a thread of the driver's process
(``AgentDoorServer``: what the NeMo-RL drop-in's ``expose_http_server`` starts); its
trajectories live in that process's memory unless a store is given. The fleet's own door, in
processes of its own behind one port with a store they share, is ``wiring/door.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout_fleet.adapters.agent_door.app import door_app
from rollout_fleet.adapters.agent_door.hop import HopSettings
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.core.agent_turns import Trajectories, TrajectoryStore


def build_door(frontend_url: str, model_path: str, served_model_name: str,
               chat: Mapping[str, str] | None = None,
               trajectories: TrajectoryStore | None = None, *,
               max_model_len: int | None = None, hop: HopSettings | None = None,
               render_threads: int = 2) -> web.Application:
    """The door's application over ``frontend_url``; ``max_model_len``: the fleet's (default:
    what the model folder's config says)."""
    template = ChatTemplate(model_path, served_model_name,
                            (chat or {}).get("custom_jinja_template"))
    return door_app(frontend_url, template, trajectories or Trajectories(),
                    max_model_len=max_model_len or model_context_length(model_path), hop=hop,
                    render_threads=render_threads)


def model_context_length(model_path: str) -> int:
    """The context length a model folder's ``config.json`` states."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ValueError(f"{model_path}/config.json states no context length: give max_model_len")


class AgentDoorServer:
    """The door on ``host:port`` (0: a free port), served by an event loop of its own thread."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-door",
                                        daemon=True)

    @classmethod
    def for_fleet(cls, fleet: Any, host: str | None = None, port: int = 0) -> "AgentDoorServer":
        """The door of a started ``Fleet``: its frontend, model folder and chat settings."""
        app = build_door(fleet.frontend_url, fleet.model_path or fleet.config.model,
                         fleet.config.served_model_name, fleet.config.chat,
                         max_model_len=fleet.config.max_model_len)
        return cls(app, host or fleet.config.bind_host, port).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "AgentDoorServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=60)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _serve(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_fleet.wiring.agent_door``: the door in processes of its own
    (``wiring/door.py``, whose flags it takes)."""
    from rollout_fleet.wiring.door import main as door_main

    return door_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
