"""Fault drills on a running fleet, for the fault tests: kill or pause a worker, kill and restart
the frontend. They act through the fleet's public parts (its placement, frontend and config);
the product itself never calls them."""

from __future__ import annotations

import os
import signal

from rollout_fleet.wiring.fleet import Fleet


class FaultDrills:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def kill_worker(self, name: str) -> None:
        """Kill one worker's process group now."""
        self.fleet.placement.kill(name)

    def pause_worker(self, name: str) -> None:
        """SIGSTOP one worker's process group: it keeps its sockets but answers nothing."""
        self.fleet.placement.signal(name, signal.SIGSTOP)

    def resume_worker(self, name: str) -> None:
        self.fleet.placement.signal(name, signal.SIGCONT)

    def kill_frontend(self) -> None:
        """SIGKILL the frontend's process group (no drain, no goodbye)."""
        frontend = self.fleet.frontend
        process = frontend.process if frontend is not None else None
        if process is None:
            return
        frontend.process = None
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def restart_frontend(self, timeout_s: float = 60.0) -> None:
        """Start the frontend again on its port; wait until it lists the model."""
        frontend = self.fleet.frontend
        if frontend.process is None:
            frontend.start()
        frontend.wait_for_model(self.fleet.config.served_model_name, timeout_s=timeout_s)
