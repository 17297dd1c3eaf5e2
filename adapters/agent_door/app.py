"""One door process's web application: the chat and completions routes (``door.py``), the rest
(``tools.py``), the trainer's controls (``controls.py``, with a checkpoint's generation fence:
``fence.py``) and NeMo-Gym's generation cuts (``cuts.py``), over one hop to the frontend, one
render pool and the trajectory store; every
answer names the door process that gave it. Its siblings reach it on a second application
(``DoorApps.siblings``), served on a Unix socket of the door's folder only."""

from __future__ import annotations

from pathlib import Path

import attrs
from aiohttp import web

from rollout_fleet.adapters.agent_door.capture import DoorCapture, StagingFactory
from rollout_fleet.adapters.agent_door.controls import DoorControls
from rollout_fleet.adapters.agent_door.cuts import GenerationCuts
from rollout_fleet.adapters.agent_door.door import AgentDoor
from rollout_fleet.adapters.agent_door.door_state import SharedState
from rollout_fleet.adapters.agent_door.fence import CheckpointControls
from rollout_fleet.adapters.agent_door.hop import FrontendHop, HopSettings
from rollout_fleet.adapters.agent_door.records import TurnRecords
from rollout_fleet.adapters.agent_door.render import Renderer
from rollout_fleet.adapters.agent_door.replies import door_middleware, name_the_door_process
from rollout_fleet.adapters.agent_door.siblings import Siblings
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.adapters.agent_door.tools import DoorTools
from rollout_fleet.core.agent_turns import TrajectoryStore
from rollout_fleet.core.clock import Clock
from rollout_fleet.core.sampling_guard import SamplingProfiles

# The largest request body a door reads (a long conversation with its tokens carried back).
MAX_BODY_BYTES = 64 << 20


@attrs.frozen
class CaptureParts:
    """What token capture needs in a door process: the state its processes share (None: no
    capture, no control), how it builds its staging, the door's own sampling profiles, the
    control secret, and the folder of its siblings' sockets with its own (None: no
    siblings)."""

    shared: SharedState | None = None
    staging_factory: StagingFactory | None = None
    sampling: SamplingProfiles | None = None
    control_secret: str | None = attrs.field(default=None, repr=False)
    folder: Path | None = None
    own_socket: Path | None = None


@attrs.frozen
class DoorApps:
    public: web.Application  # the door's URL
    siblings: web.Application  # the door's other processes, on this process's Unix socket


def door_apps(frontend_url: str, template: ChatTemplate, store: TrajectoryStore, *,
              max_model_len: int, hop: HopSettings | None = None, render_threads: int = 2,
              clock: Clock | None = None, capture: CaptureParts | None = None) -> DoorApps:
    parts = capture or CaptureParts()
    frontend = FrontendHop(frontend_url, hop)
    renderer = Renderer(template, render_threads)
    records = TurnRecords(store, clock)
    capturing = DoorCapture(parts.shared, parts.staging_factory, parts.sampling)
    siblings = Siblings(parts.folder, parts.own_socket)
    cuts = GenerationCuts(capturing, renderer, siblings)
    fence_controls = (CheckpointControls(parts.shared, capturing.fence, siblings).handlers()
                      if parts.shared is not None else {})
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[door_middleware])
    AgentDoor(frontend, renderer, records, max_model_len=max_model_len,
              capture=capturing).add_routes(app)
    DoorTools(frontend, renderer, records, max_model_len=max_model_len).add_routes(app)
    DoorControls(capturing, parts.control_secret, fence_controls).add_routes(app)
    cuts.add_routes(app)
    app.on_response_prepare.append(name_the_door_process)
    sibling_app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[door_middleware])
    cuts.add_sibling_routes(sibling_app)
    capturing.fence.add_sibling_routes(sibling_app)

    async def close(_app: web.Application) -> None:
        await frontend.close()
        renderer.close()
        records.close()
        capturing.close()
        if parts.shared is not None:
            parts.shared.close()

    app.on_cleanup.append(close)
    return DoorApps(app, sibling_app)


def door_app(frontend_url: str, template: ChatTemplate, store: TrajectoryStore, *,
             max_model_len: int, hop: HopSettings | None = None, render_threads: int = 2,
             clock: Clock | None = None) -> web.Application:
    """A door without token capture, controls or siblings (the drop-in's door in a thread)."""
    return door_apps(frontend_url, template, store, max_model_len=max_model_len, hop=hop,
                     render_threads=render_threads, clock=clock).public
