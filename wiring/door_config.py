"""The ``[door]`` section of a fleet's config: the door (wiring/door.py), the fleet's one URL
for every client."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field


def default_door_processes() -> int:
    """One door process a core, at most four (a door process is one event loop)."""
    return max(1, min(4, os.cpu_count() or 1))


class DoorSection(BaseModel):
    """The fleet's door (wiring/door.py): its one URL for every client. Its hop to the
    frontend takes the fleet's ``timeouts`` (connect_s, request_s) and ``retry``."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    processes: int = Field(
        default_factory=default_door_processes, ge=0, le=256,
        description="door processes behind the door's one port (SO_REUSEPORT); 0: no door, "
        "for a fleet used only through its driver")
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    trajectories: int = Field(default=4096, ge=1, description="named trajectories (and "
                              "sessions) the door holds, the least recently used forgotten first")
    idle_s: float = Field(default=3600.0, gt=0, description="a trajectory idle this long is "
                          "forgotten")
    render_threads: int = Field(default=2, ge=1, le=64,
                                description="chat rendering threads in each door process")
