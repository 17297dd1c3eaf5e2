"""One door process (``wiring/door.py`` starts them): the door's application on the door's
``host:port``, bound with SO_REUSEPORT beside its siblings, over the store they share, and its
siblings' application on ``cut-<pid>.sock`` in the door's folder; it reads the control secret
from its standard input (one line; empty: none), writes ``ready-<pid>`` in the door's folder
once it serves, and stops on SIGTERM or SIGINT.

Token capture stages into NeMo-RL's TransferQueue: a door process joins the trainer's Ray
cluster (the setup's ``ray_address``, else ``RAY_ADDRESS``) and attaches to its TransferQueue
the first time it needs to, in a thread off its event loop.

    python -m rollout_fleet.wiring.door_process <door folder>/door.json
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout_fleet.adapters.agent_door.app import CaptureParts, DoorApps, door_apps
from rollout_fleet.adapters.agent_door.capture import StagingFactory
from rollout_fleet.adapters.agent_door.cuts import sibling_socket
from rollout_fleet.adapters.agent_door.door_state import CaptureSettings, DoorState, SharedState
from rollout_fleet.adapters.agent_door.hop import HopSettings
from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.core.capture_records import StagingUnavailable
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.sampling_guard import SamplingProfiles
from rollout_fleet.core.token_capture import TokenStaging

# A Unix socket's path is at most 107 bytes (sun_path).
MAX_SOCKET_PATH = 107


def transfer_queue_staging() -> StagingFactory:
    """Staging in the trainer's TransferQueue, this process attached to it once."""
    attached = threading.Lock()

    def staging(settings: CaptureSettings) -> TokenStaging:
        from rollout_fleet.adapters.transfer_queue import (
            TransferQueueStaging, attach_transfer_queue,
        )

        with attached:
            _join_ray(settings.ray_address)
            attach_transfer_queue()
        return TransferQueueStaging(settings.staging_partition)

    return staging


def _join_ray(address: str | None) -> None:
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise StagingUnavailable("no Ray cluster to join: the setup names no ray_address and "
                                 "RAY_ADDRESS is unset")
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False,
                 include_dashboard=False)
    except Exception as exc:  # Ray's own errors (ConnectionError, RuntimeError, ...)
        raise StagingUnavailable(f"could not join the Ray cluster at {address}: "
                                 f"{type(exc).__name__}: {exc}") from exc


def application(spec: dict[str, Any], store: SqliteTrajectories, secret: str | None) -> DoorApps:
    template = ChatTemplate(spec["model_path"], spec["served_model_name"],
                            spec.get("custom_jinja_template"), load_now=False)
    hop = HopSettings(connect_s=spec["connect_s"], read_s=spec["read_s"],
                      retry=RetryPolicy(**spec["retry"]))
    folder = Path(spec["ready_folder"])
    sampling = spec.get("sampling")
    parts = CaptureParts(
        SharedState(DoorState(spec["store"])), transfer_queue_staging(),
        SamplingProfiles.from_wire(sampling) if sampling else None, secret, folder,
        sibling_socket(folder, os.getpid()))
    return door_apps(spec["frontend_url"], template, store, max_model_len=spec["max_model_len"],
                     hop=hop, render_threads=spec["render_threads"], capture=parts)


async def serve(apps: DoorApps, spec: dict[str, Any]) -> None:
    grace = max(0.5, float(spec["stop_s"]) / 2)
    runner = web.AppRunner(apps.public, access_log=None, shutdown_timeout=grace)
    siblings = web.AppRunner(apps.siblings, access_log=None, shutdown_timeout=grace)
    socket = sibling_socket(Path(spec["ready_folder"]), os.getpid())
    await runner.setup()
    await siblings.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, spec["host"], spec["port"], reuse_port=True).start()
        socket.unlink(missing_ok=True)
        if len(os.fsencode(socket)) <= MAX_SOCKET_PATH:
            await web.UnixSite(siblings, str(socket)).start()
        else:  # siblings cannot reach it: its calls cannot be cut from them (said in its log)
            print(f"door: {socket} is too long a socket path; cuts reach this process only "
                  "directly", file=sys.stderr, flush=True)
        (Path(spec["ready_folder"]) / f"ready-{os.getpid()}").write_text("serving\n")
        await stop.wait()
    finally:
        await siblings.cleanup()
        await runner.cleanup()
        socket.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    (spec_path,) = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    secret = sys.stdin.readline().strip() or None
    store = SqliteTrajectories(spec["store"], spec["trajectories"], spec["idle_s"])
    try:
        asyncio.run(serve(application(spec, store, secret), spec))
    finally:
        store.close()
    gc.freeze()  # the exit's last collection skips the heap: a loaded tokenizer's torch made it ~1 s
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
