"""One door process (``wiring/door.py`` starts them): the door's application on the door's
``host:port``, bound with SO_REUSEPORT beside its siblings, over the store they share; it
writes ``ready-<pid>`` in the door's folder once it serves, and stops on SIGTERM or SIGINT.

    python -m rollout_fleet.wiring.door_process <door folder>/door.json
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout_fleet.adapters.agent_door.app import door_app
from rollout_fleet.adapters.agent_door.hop import HopSettings
from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.core.retry import RetryPolicy


def application(spec: dict[str, Any], store: SqliteTrajectories) -> web.Application:
    template = ChatTemplate(spec["model_path"], spec["served_model_name"],
                            spec.get("custom_jinja_template"))
    hop = HopSettings(connect_s=spec["connect_s"], read_s=spec["read_s"],
                      retry=RetryPolicy(**spec["retry"]))
    return door_app(spec["frontend_url"], template, store, max_model_len=spec["max_model_len"],
                    hop=hop, render_threads=spec["render_threads"])


async def serve(app: web.Application, spec: dict[str, Any]) -> None:
    runner = web.AppRunner(app, access_log=None,
                           shutdown_timeout=max(0.5, float(spec["stop_s"]) / 2))
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, spec["host"], spec["port"], reuse_port=True).start()
        (Path(spec["ready_folder"]) / f"ready-{os.getpid()}").write_text("serving\n")
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    (spec_path,) = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    store = SqliteTrajectories(spec["store"], spec["trajectories"], spec["idle_s"])
    try:
        asyncio.run(serve(application(spec, store), spec))
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
