"""Fault drills on a running fleet (the fault tests and benches use them): kill or pause a
worker, kill and restart the frontend. A mixin of ``Fleet``: it uses the fleet's placement,
frontend and config."""

from __future__ import annotations

import os
import signal


class FaultDrills:
    """Needs ``placement``, ``frontend`` and ``config`` on the class it is mixed into."""

    __slots__ = ()

    def kill_worker(self, name: str) -> None:
        """Kill one worker's process group now."""
        self.placement.kill(name)

    def pause_worker(self, name: str) -> None:
        """SIGSTOP one worker's process group: it keeps its sockets but answers nothing."""
        self.placement.signal(name, signal.SIGSTOP)

    def resume_worker(self, name: str) -> None:
        self.placement.signal(name, signal.SIGCONT)

    def kill_frontend(self) -> None:
        """SIGKILL the frontend's process group (no drain, no goodbye)."""
        process = self.frontend.process if self.frontend is not None else None
        if process is None:
            return
        self.frontend.process = None
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def restart_frontend(self, timeout_s: float = 60.0) -> None:
        """Start the frontend again on its port; wait until it lists the model."""
        if self.frontend.process is None:
            self.frontend.start()
        self.frontend.wait_for_model(self.config.served_model_name, timeout_s=timeout_s)
