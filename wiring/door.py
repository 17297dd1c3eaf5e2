"""The fleet's door: several door processes (adapters/agent_door) behind one ``host:port``,
each binding it with SO_REUSEPORT, so the kernel spreads new connections over them; each in a
process group of its own, stopped by that group. They share one trajectory store (SQLite, in
``<run_dir>/door/``): a turn any of them recorded is continued by any other, and one that dies
loses nothing. Each process loads the model's tokenizer at the first request that needs it
(``adapters/agent_door/template.py``), so a door starts in well under a second a process.

``Fleet.start`` starts the fleet's door once its workers are registered (``[door]`` in its
config; ``fleet.door``, ``fleet.door_url``) and its shutdown stops it first
(``wiring/fleet_services.py``). By hand, in front of any frontend:

    door = start_door(fleet.frontend_url, fleet.model_path, config.served_model_name,
                      config.chat, max_model_len=config.max_model_len, host=config.bind_host,
                      port=0, processes=None, run_dir=some_folder,
                      control_secret=fleet.secret)
    door.url            # http://host:port (OpenAI clients: door.url + "/v1")
    door.controls()     # the trainer's token-capture controls (DoorControlClient)
    door.replace_dead() # a new process in place of each that died (e.g. in a watch loop)
    door.stop()         # every process group, then the port's claim; safe to repeat

or from a shell: ``python -m rollout_fleet.wiring.door --frontend-url URL --model DIR``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rollout_fleet.adapters.agent_door.cuts import SOCKET_GLOB, sibling_socket
from rollout_fleet.adapters.agent_door.store import SqliteTrajectories
from rollout_fleet.adapters.shared import PortsTaken, read_tail
from rollout_fleet.adapters.shared.processes import interrupts_held, signal_group
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.sampling_guard import SamplingProfiles
from rollout_fleet.core.validate import finite_at_least, positive_int
from rollout_fleet.wiring.door_config import default_door_processes
from rollout_fleet.wiring.door_control_client import DoorControlClient


@attrs.frozen
class DoorSettings:
    """How the door is run (the ``[door]`` settings a fleet config would carry)."""

    processes: int = attrs.field(factory=default_door_processes,
                                 validator=positive_int("door.processes"))
    connect_s: float = attrs.field(default=10.0,
                                   validator=finite_at_least("door.connect_s", strictly=True))
    read_s: float = attrs.field(default=600.0,
                                validator=finite_at_least("door.read_s", strictly=True))
    retry: RetryPolicy = RetryPolicy()
    # The store: at most this many trajectories (and as many sessions), each forgotten after
    # idling this long.
    trajectories: int = attrs.field(default=4096, validator=positive_int("door.trajectories"))
    idle_s: float = attrs.field(default=3600.0,
                                validator=finite_at_least("door.idle_s", strictly=True))
    render_threads: int = attrs.field(default=2, validator=positive_int("door.render_threads"))
    start_s: float = attrs.field(default=120.0,
                                 validator=finite_at_least("door.start_s", strictly=True))
    stop_s: float = attrs.field(default=10.0,
                                validator=finite_at_least("door.stop_s", strictly=True))
    # The trainer's sampling profiles every chat request must match (None: no guard until a
    # token-capture setup gives them).
    sampling: SamplingProfiles | None = None


class DoorStartError(RolloutFleetError):
    """A door process did not come up; carries its log's tail."""


@attrs.define
class DoorProcesses:
    """The started door: its URL and its processes (each the leader of its own group)."""

    host: str
    port: int
    folder: Path
    settings: DoorSettings
    _spec: Path
    _ports: PortsTaken
    _secret: str | None = attrs.field(default=None, repr=False)
    _slots: list[subprocess.Popen[bytes] | None] = attrs.field(factory=list)
    _stopped: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        """The door processes' pids (alive or not); each is its process group's id too."""
        return [process.pid for process in self._slots if process is not None]

    @property
    def process_groups(self) -> list[int]:
        return self.pids

    def controls(self, timeout_s: float = 120.0) -> DoorControlClient:
        """A client of the door's controls (token capture's setup, the weight version)."""
        if self._secret is None:
            raise DoorStartError("this door was started without a control secret: it takes "
                                 "no control")
        return DoorControlClient(self.url, self._secret, timeout_s)

    def alive(self) -> list[int]:
        return [p.pid for p in self._slots if p is not None and p.poll() is None]

    def replace_dead(self) -> list[int]:
        """Start a process in place of each that exited; the new pids, once they serve."""
        if self._stopped:
            return []
        dead = [i for i, p in enumerate(self._slots) if p is not None and p.poll() is not None]
        for index in dead:
            gone = self._slots[index]
            if gone is not None:
                sibling_socket(self.folder, gone.pid).unlink(missing_ok=True)
            self._launch(index)
        self._wait_ready(dead)
        return [process.pid for i, process in enumerate(self._slots)
                if i in dead and process is not None]

    def stop(self) -> None:
        """SIGTERM every door process group, SIGKILL what is left after ``stop_s``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        processes = [p for p in self._slots if p is not None]
        for process in processes:
            signal_group(process.pid, signal.SIGCONT)
            signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_s
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in processes:  # the leader may be gone while others in its group linger
            signal_group(process.pid, signal.SIGKILL)
            process.wait()
        for left in [*self.folder.glob("ready-*"), *self.folder.glob(SOCKET_GLOB)]:
            left.unlink(missing_ok=True)
        self._ports.release()

    def start(self) -> "DoorProcesses":
        try:
            self._slots = [None] * self.settings.processes
            for index in range(self.settings.processes):
                self._launch(index)
            self._wait_ready(range(self.settings.processes))
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, index: int) -> None:
        """Start door process ``index`` in its slot (recorded before an interrupt can land)."""
        command = [sys.executable, "-m", "rollout_fleet.wiring.door_process", str(self._spec)]
        log = self.folder / f"door-{index}.log"
        with interrupts_held(), open(log, "ab") as out:
            process = self._slots[index] = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                process_group=0, cwd=self.folder)
        assert process.stdin is not None
        try:  # the secret on its standard input, never in its arguments or the spec file
            process.stdin.write(f"{self._secret or ''}\n".encode())
            process.stdin.close()
        except OSError:  # it exited already: _wait_ready says so, with its log
            pass

    def _wait_ready(self, indexes: Any) -> None:
        deadline = time.monotonic() + self.settings.start_s
        for index in indexes:
            process = self._slots[index]
            assert process is not None
            ready = self.folder / f"ready-{process.pid}"
            while not ready.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    why = f"exited with code {process.returncode}" if process.poll() \
                        is not None else f"did not serve within {self.settings.start_s:.0f} s"
                    log = self.folder / f"door-{index}.log"
                    raise DoorStartError(f"door process {index} (pid {process.pid}) {why}; "
                                         f"log {log}:\n{read_tail(log)}")
                time.sleep(0.05)


def start_door(frontend_url: str, model_path: str, served_model_name: str,
               chat: Mapping[str, Any] | None = None, *, max_model_len: int,
               host: str = "127.0.0.1", port: int = 0, processes: int | None = None,
               run_dir: str | Path, settings: DoorSettings | None = None,
               control_secret: str | None = None) -> DoorProcesses:
    """Start the door's processes on ``host:port`` (0: a free port) and wait until each
    serves; DoorStartError (with the log's tail) if one does not. ``processes`` overrides
    ``settings.processes``. A store left in ``run_dir`` by an earlier door is removed first:
    its trajectories' workers are gone, and its token-capture setup with them.
    ``control_secret`` (the fleet's): what every control call must carry (None: the door
    takes no control)."""
    return door_processes(frontend_url, model_path, served_model_name, chat,
                          max_model_len=max_model_len, host=host, port=port, processes=processes,
                          run_dir=run_dir, settings=settings,
                          control_secret=control_secret).start()


def door_processes(frontend_url: str, model_path: str, served_model_name: str,
                   chat: Mapping[str, Any] | None = None, *, max_model_len: int,
                   host: str = "127.0.0.1", port: int = 0, processes: int | None = None,
                   run_dir: str | Path, settings: DoorSettings | None = None,
                   control_secret: str | None = None) -> DoorProcesses:
    """The door as ``start_door`` starts it, not started yet (its spec written, its port
    claimed): a caller records it first, then calls ``start``."""
    settings = settings or DoorSettings()
    if processes is not None:
        settings = attrs.evolve(settings, processes=processes)
    folder = Path(run_dir) / "door"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = folder / "trajectories.sqlite"
    for old in (store, store.with_name(store.name + "-wal"), store.with_name(store.name + "-shm")):
        old.unlink(missing_ok=True)
    # Its tables and write-ahead log made once here, not by every process at once.
    SqliteTrajectories(store, settings.trajectories, settings.idle_s).close()
    ports = PortsTaken()
    port = port or ports.take(host)
    spec = folder / "door.json"
    spec.write_text(json.dumps({
        "frontend_url": frontend_url, "model_path": str(model_path),
        "served_model_name": served_model_name,
        "custom_jinja_template": (chat or {}).get("custom_jinja_template"),
        "max_model_len": max_model_len, "host": host, "port": port, "store": str(store),
        "trajectories": settings.trajectories, "idle_s": settings.idle_s,
        "connect_s": settings.connect_s, "read_s": settings.read_s,
        "retry": attrs.asdict(settings.retry), "render_threads": settings.render_threads,
        "stop_s": settings.stop_s, "ready_folder": str(folder),
        "sampling": settings.sampling.to_wire() if settings.sampling else None}))
    return DoorProcesses(host, port, folder, settings, spec, ports, control_secret)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_fleet.wiring.door",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend-url", required=True, help="the fleet's frontend_url")
    parser.add_argument("--model", required=True, help="the fleet's model folder")
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--custom-jinja-template", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--run-dir", required=True, help="where the store and logs go")
    args = parser.parse_args(argv)
    chat = {"custom_jinja_template": args.custom_jinja_template}
    door = start_door(args.frontend_url, args.model, args.served_model_name, chat,
                      max_model_len=args.max_model_len, host=args.host, port=args.port,
                      processes=args.processes, run_dir=args.run_dir)
    print(f"door: {door.url} (processes {door.pids}); Ctrl-C stops it", flush=True)
    try:  # blocked only now: the door's processes must not inherit the mask
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        door.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
