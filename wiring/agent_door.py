"""Serve the agent door (adapters/agent_door) for a fleet: in a thread of the driver's process
(``AgentDoorServer``: what the NeMo-RL drop-in's ``expose_http_server`` starts), or as a
process of its own:

    python -m rollout_fleet.wiring.agent_door --frontend-url URL --model DIR [--port P]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Mapping

from aiohttp import web

from rollout_fleet.adapters.agent_door.door import AgentDoor
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.core.agent_turns import Trajectories


def build_door(frontend_url: str, model_path: str, served_model_name: str,
               chat: Mapping[str, str] | None = None,
               trajectories: Trajectories | None = None) -> AgentDoor:
    template = ChatTemplate(model_path, served_model_name,
                            (chat or {}).get("custom_jinja_template"))
    return AgentDoor(frontend_url, template, trajectories=trajectories)


class AgentDoorServer:
    """The door on ``host:port`` (0: a free port), served by an event loop of its own thread."""

    def __init__(self, door: AgentDoor, host: str = "127.0.0.1", port: int = 0) -> None:
        self.door = door
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-door",
                                        daemon=True)

    @classmethod
    def for_fleet(cls, fleet, host: str | None = None, port: int = 0) -> "AgentDoorServer":
        """The door of a started ``Fleet``: its frontend, model folder and chat settings."""
        door = build_door(fleet.frontend_url, fleet.model_path or fleet.config.model,
                          fleet.config.served_model_name, fleet.config.chat)
        return cls(door, host or fleet.config.bind_host, port).start()

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
        self._runner = web.AppRunner(self.door.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_fleet.wiring.agent_door",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend-url", required=True, help="the fleet's frontend_url")
    parser.add_argument("--model", required=True, help="the fleet's model folder")
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--custom-jinja-template", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    args = parser.parse_args(argv)
    template = args.custom_jinja_template
    chat = {"custom_jinja_template": template} if template else {}
    door = build_door(args.frontend_url, args.model, args.served_model_name, chat)
    web.run_app(door.app(), host=args.host, port=args.port, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
