"""One door process's web application: the chat and completions routes (``door.py``) and the
rest (``tools.py``) over one hop to the frontend, one render pool and the trajectory store;
every answer names the door process that gave it."""

from __future__ import annotations

from aiohttp import web

from rollout_fleet.adapters.agent_door.door import AgentDoor
from rollout_fleet.adapters.agent_door.hop import FrontendHop, HopSettings
from rollout_fleet.adapters.agent_door.records import TurnRecords
from rollout_fleet.adapters.agent_door.render import Renderer
from rollout_fleet.adapters.agent_door.replies import door_middleware, name_the_door_process
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.adapters.agent_door.tools import DoorTools
from rollout_fleet.core.agent_turns import TrajectoryStore
from rollout_fleet.core.clock import Clock

# The largest request body a door reads (a long conversation with its tokens carried back).
MAX_BODY_BYTES = 64 << 20


def door_app(frontend_url: str, template: ChatTemplate, store: TrajectoryStore, *,
             max_model_len: int, hop: HopSettings | None = None, render_threads: int = 2,
             clock: Clock | None = None) -> web.Application:
    frontend = FrontendHop(frontend_url, hop)
    renderer = Renderer(template, render_threads)
    records = TurnRecords(store, clock)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[door_middleware])
    AgentDoor(frontend, renderer, records, max_model_len=max_model_len).add_routes(app)
    DoorTools(frontend, renderer, records, max_model_len=max_model_len).add_routes(app)
    app.on_response_prepare.append(name_the_door_process)

    async def close(_app: web.Application) -> None:
        await frontend.close()
        renderer.close()
        records.close()

    app.on_cleanup.append(close)
    return app
