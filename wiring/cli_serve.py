"""``rollout-fleet serve --config FILE``: start a fleet and keep it up until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from rollout_fleet.adapters.shared.processes import interrupt
from rollout_fleet.ports.placement import PlacementKind


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="start a fleet and keep it up until Ctrl-C",
        description="Start a fleet (workers on Ray, a Dynamo frontend, the door in front of "
                    "it), print the fleet's URL (the door's: every client's, OpenAI base URL "
                    "URL/v1) and the workers' control endpoints, write a fleet file for "
                    "`generate` and `refit`, and serve until Ctrl-C or SIGTERM; then stop "
                    "everything. A door process that dies is replaced.")
    serve.add_argument("--config", required=True, help="the fleet config (TOML or JSON); see "
                                                       "docs/running-a-fleet.md")
    serve.add_argument("--fleet-file", default=None,
                       help="where to write the fleet file (default <run_dir>/fleet.json)")
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from rollout_fleet.wiring.config import load_config

    config = load_config(args.config)  # a bad config fails here, before anything starts
    from rollout_fleet.wiring.fleet import Fleet
    from rollout_fleet.wiring.fleet_file import FleetFile

    stop = threading.Event()
    # Before our handlers: ray.init replaces SIGTERM's.
    ray_started = _start_ray(config) if config.placement is PlacementKind.RAY else False
    try:
        _stop_on_signals(stop)
        fleet = Fleet.start(config)  # stops what it started if it fails or is interrupted
        fleet_file = Path(args.fleet_file or fleet.run_dir / "fleet.json").resolve()
        try:
            FleetFile.of_fleet(fleet).write(fleet_file)
            _print_urls(fleet)
            for name, url in fleet.control_urls.items():
                print(f"control {name}: {url}/engine/control/<name>")
            print(f"fleet file: {fleet_file}")
            print("serving; Ctrl-C or SIGTERM stops the fleet", flush=True)
            _serve_until(stop, fleet, fleet_file)
        finally:
            fleet_file.unlink(missing_ok=True)
            fleet.shutdown()
    finally:
        if ray_started:
            import ray

            ray.shutdown()
    print("fleet stopped", flush=True)
    return 0


def _print_urls(fleet) -> None:
    if fleet.door is not None:
        print(f"url: {fleet.door_url} (OpenAI base URL {fleet.door_url}/v1; "
              f"{len(fleet.door.pids)} door processes)")
        print(f"frontend (internal: the driver's rollouts): {fleet.frontend_url}")
    else:
        print(f"url: {fleet.frontend_url} (the frontend: no door, [door] processes = 0)")


def _start_ray(config) -> bool:
    """Start (or join) Ray here, as the placement would, so that the signal handlers installed
    next are ours: a SIGTERM while the fleet starts then unwinds the start (which stops what it
    started) instead of hitting Ray's handler, which ends the process and leaves workers."""
    import os

    import ray

    if ray.is_initialized():
        return False
    options = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if config.ray_address:
        if config.spans_nodes:  # join from this node's cluster address (RayPlacement does too)
            options["_node_ip_address"] = config.bind_host
        ray.init(address=config.ray_address, **options)
    else:
        cpus = max(os.cpu_count() or 1, int(config.num_workers * config.cpus_per_worker))
        ray.init(num_cpus=cpus, _node_ip_address=config.bind_host, **options)
    return True


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, _frame: object) -> None:
        if stop.is_set():
            return
        stop.set()
        if not _serving.is_set():  # still starting: unwind Fleet.start (it cleans up)
            interrupt()  # held while a child is started and not yet recorded

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


_serving = threading.Event()
_WATCH_INTERVAL_S = 1.0  # how often `serve` looks for lost and joined workers


def _serve_until(stop: threading.Event, fleet, fleet_file: Path) -> None:
    """Report each lost worker and each that joined (``replace_lost_workers``), replace each
    door process that died; the fleet file lists the live workers and door processes."""
    from rollout_fleet.wiring.fleet_file import FleetFile

    _serving.set()
    reported: set[str] = set()
    known = set(fleet.control_urls)
    while not stop.wait(_WATCH_INTERVAL_S):
        lost = fleet.lost_workers()
        newly_lost = sorted(set(lost) - reported)
        for name in newly_lost:
            print(f"warning: {name} lost, out of the frontend's routing: {lost[name]}",
                  file=sys.stderr, flush=True)
        reported.update(newly_lost)
        joined = sorted({e.worker_id for e in fleet.endpoints(live_only=True)} - known)
        for name in joined:
            print(f"warning: {name} joined; it serves once the next refit has loaded the "
                  f"current weights on it", file=sys.stderr, flush=True)
        known.update(joined)
        if _replace_dead_door_processes(fleet) or newly_lost or joined:
            FleetFile.of_fleet(fleet).write(fleet_file)


def _replace_dead_door_processes(fleet) -> bool:
    """A new door process in place of each that died (tried again next time if one fails to
    start); whether any was replaced."""
    from rollout_fleet.wiring.door import DoorStartError

    door = fleet.door
    if door is None:
        return False
    dead = sorted(set(door.pids) - set(door.alive()))
    if not dead:
        return False
    try:
        started = door.replace_dead()
    except DoorStartError as exc:
        print(f"warning: door process(es) {dead} died; a replacement failed to start: "
              f"{str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        return True
    print(f"warning: door process(es) {dead} died; replaced by {started}", file=sys.stderr,
          flush=True)
    return True
