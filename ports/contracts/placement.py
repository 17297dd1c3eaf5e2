"""The placement port's contract suite.

Provide a ``placement_under_test`` fixture that yields a fresh ``Placement`` placing workers on
this machine (and stops it afterwards). Each test starts small Python processes as workers.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.ports.placement import Placement, WorkerHandle, WorkerLaunch

# A worker that proves what it was given: it binds its port and prints it with its mark.
_WORKER = """
import os, socket, time
port = int(os.environ["CONTRACT_PORT"])
server = socket.socket()
server.bind(("127.0.0.1", port))
server.listen()
print("listening", port, os.environ.get("CONTRACT_MARK"), flush=True)
time.sleep(600)
"""


# A worker that reads its secret from standard input and shows only a digest of it.
_SECRET_WORKER = """
import hashlib, sys, time
line = sys.stdin.readline().strip()
print("secret digest", hashlib.sha256(line.encode()).hexdigest(), flush=True)
time.sleep(600)
"""


# A worker that leaves a shared-memory segment behind when it dies, as vLLM's engine core does.
_SEGMENT_WORKER = """
import time
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(segment._name, "shared_memory")  # nothing removes it at exit
print("segment", segment.name, flush=True)
time.sleep(600)
"""


# A worker that leaves a file in the folder its placement made for it.
_FOLDER_WORKER = """
import os, pathlib, time
folder = pathlib.Path(os.environ["CONTRACT_FOLDER"])
(folder / "left-behind").write_text("a worker's file")
print("folder", folder, flush=True)
time.sleep(600)
"""


def _launch(tmp_path: Path, name: str) -> WorkerLaunch:
    return WorkerLaunch(name=name, argv=(sys.executable, "-c", _WORKER),
                        env={"CONTRACT_MARK": f"mark-of-{name}"},
                        log_path=str(tmp_path / f"{name}.log"), port_env=("CONTRACT_PORT",))


def _assert_listening(handle: WorkerHandle) -> None:
    """The worker bound the port its handle names and logged its own mark."""
    log = Path(handle.log_path)
    want = f"listening {handle.ports['CONTRACT_PORT']} mark-of-{handle.name}"
    assert wait_until(lambda: log.exists() and want in log.read_text()), \
        f"{handle.name} did not bind its port: {log.read_text() if log.exists() else '(no log)'}"


def _logged(handle: WorkerHandle, mark: str) -> str:
    """What the worker printed after ``mark``, once the whole line is in its log (a worker
    writing unbuffered writes a printed line in parts)."""
    log = Path(handle.log_path)
    line = re.compile(rf"^{mark} (\S+)\n", re.MULTILINE)
    assert wait_until(lambda: log.exists() and line.search(log.read_text()) is not None), \
        f"{handle.name} did not log its {mark}: {log.read_text() if log.exists() else '(no log)'}"
    found = line.search(log.read_text())
    assert found is not None
    return found.group(1)


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (checked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


class PlacementContract:
    def test_launch_starts_each_worker_with_its_env_port_and_log(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        handles = placement.launch([_launch(tmp_path, "w0"), _launch(tmp_path, "w1")])
        assert [(h.index, h.name) for h in handles] == [(0, "w0"), (1, "w1")]
        ports = [h.ports["CONTRACT_PORT"] for h in handles]
        assert set(handles[0].ports) == {"CONTRACT_PORT"} and len(set(ports)) == 2
        for handle, port in zip(handles, ports):
            log = Path(handle.log_path)
            want = f"listening {port} mark-of-{handle.name}"
            assert wait_until(lambda: log.exists() and want in log.read_text()), \
                f"{handle.name} did not bind its port: {log.read_text() if log.exists() else '(no log)'}"
        assert placement.alive() == {"w0": True, "w1": True}

    def test_the_secret_reaches_the_worker_on_stdin_only(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        import hashlib

        placement = placement_under_test
        secret = os.urandom(16).hex()
        launch = WorkerLaunch(name="w0", argv=(sys.executable, "-c", _SECRET_WORKER),
                              log_path=str(tmp_path / "w0.log"), secret=secret)
        assert secret not in repr(launch)
        (handle,) = placement.launch([launch])
        log = Path(handle.log_path)
        want = f"secret digest {hashlib.sha256(secret.encode()).hexdigest()}"
        assert wait_until(lambda: log.exists() and want in log.read_text()), \
            log.read_text() if log.exists() else "(no log)"
        for part in ("cmdline", "environ"):
            with open(f"/proc/{handle.pid}/{part}", "rb") as seen:
                assert secret.encode() not in seen.read(), part

    def test_segments_a_worker_leaves_in_dev_shm_are_removed_and_no_others(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        handles = placement.launch([WorkerLaunch(name=name, argv=(sys.executable, "-c", _SEGMENT_WORKER),
                                                 log_path=str(tmp_path / f"{name}.log"))
                                    for name in ("w0", "w1")])
        segments = {handle.name: Path("/dev/shm") / _logged(handle, "segment") for handle in handles}
        not_theirs = Path("/dev/shm", f"psm_{os.urandom(4).hex()}")  # another program's
        not_theirs.write_bytes(b"not a worker's")
        try:
            assert all(path.exists() for path in segments.values())
            placement.kill("w0")
            assert not segments["w0"].exists() and segments["w1"].exists()
            placement.stop()
            assert not segments["w1"].exists()
            assert not_theirs.read_bytes() == b"not a worker's"
        finally:
            not_theirs.unlink(missing_ok=True)

    def test_a_workers_own_folder_is_private_and_removed_once_it_is_gone(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        handles = placement.launch([WorkerLaunch(name=name, argv=(sys.executable, "-c", _FOLDER_WORKER),
                                                 log_path=str(tmp_path / f"{name}.log"),
                                                 folder_env="CONTRACT_FOLDER")
                                    for name in ("w0", "w1")])
        folders = {handle.name: Path(_logged(handle, "folder")) for handle in handles}
        assert folders["w0"] != folders["w1"]
        assert all((folder / "left-behind").exists() for folder in folders.values())
        assert all(folder.stat().st_mode & 0o077 == 0 for folder in folders.values())
        placement.kill("w0")
        assert not folders["w0"].exists() and folders["w1"].exists()
        placement.stop()
        assert not folders["w1"].exists()

    def test_kill_stops_that_worker_only(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        w0, w1 = placement.launch([_launch(tmp_path, "w0"), _launch(tmp_path, "w1")])
        placement.kill("w0")
        assert wait_until(lambda: placement.alive() == {"w0": False, "w1": True}), placement.alive()
        assert _gone(w0.pid) and not _gone(w1.pid)
        # How each ended, for the fleet's error: killed by SIGKILL; the other still running.
        assert placement.exit_status("w0") == -signal.SIGKILL
        assert placement.exit_status("w1") is None

    def test_a_signal_reaches_the_workers_process_group(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        (w0,) = placement.launch([_launch(tmp_path, "w0")])
        placement.signal("w0", signal.SIGSTOP)
        assert wait_until(lambda: _state(w0.pid) == "T"), _state(w0.pid)
        placement.signal("w0", signal.SIGCONT)
        assert wait_until(lambda: _state(w0.pid) not in ("T", None)), _state(w0.pid)
        assert placement.alive() == {"w0": True}

    def test_stop_ends_every_worker_even_a_paused_one_and_is_safe_to_repeat(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        handles = placement.launch([_launch(tmp_path, "w0"), _launch(tmp_path, "w1")])
        placement.signal("w1", signal.SIGSTOP)
        placement.stop()
        assert wait_until(lambda: all(_gone(h.pid) for h in handles)), \
            {h.name: _state(h.pid) for h in handles}
        placement.stop()

    def test_each_worker_leads_a_process_group_of_its_own(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        # A worker leads a process group of its own: what it starts is stopped with it.
        placement = placement_under_test
        (w0,) = placement.launch([_launch(tmp_path, "w0")])
        assert wait_until(lambda: _state(w0.pid) is not None)
        assert os.getpgid(w0.pid) == w0.pid

    def test_a_later_launch_adds_a_worker_beside_the_running_ones(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        (w0,) = placement.launch([_launch(tmp_path, "w0")])
        _assert_listening(w0)
        (w1,) = placement.launch([_launch(tmp_path, "w1")])
        assert (w1.index, w1.name) == (1, "w1")
        assert w1.ports["CONTRACT_PORT"] != w0.ports["CONTRACT_PORT"] and w1.log_path != w0.log_path
        _assert_listening(w1)
        assert placement.alive() == {"w0": True, "w1": True}
        placement.kill("w1")
        assert wait_until(lambda: placement.alive() == {"w0": True, "w1": False}), placement.alive()
        assert _gone(w1.pid) and not _gone(w0.pid)

    def test_stop_ends_the_workers_of_every_launch(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        first = placement.launch([_launch(tmp_path, "w0")])
        added = placement.launch([_launch(tmp_path, "w1"), _launch(tmp_path, "w2")])
        assert [(h.index, h.name) for h in added] == [(1, "w1"), (2, "w2")]
        handles = [*first, *added]
        assert wait_until(lambda: all(_state(h.pid) is not None for h in handles))
        placement.stop()
        assert wait_until(lambda: all(_gone(h.pid) for h in handles)), \
            {h.name: _state(h.pid) for h in handles}

    def test_a_name_taken_by_an_earlier_launch_is_refused_and_the_placement_keeps_working(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        (w0,) = placement.launch([_launch(tmp_path, "w0")])
        with pytest.raises(RolloutFleetError, match=r"\bw0\b"):
            placement.launch([_launch(tmp_path, "w1"), _launch(tmp_path, "w0")])
        assert placement.alive() == {"w0": True}  # nothing of the refused launch started
        (w1,) = placement.launch([_launch(tmp_path, "w1")])
        assert (w1.index, w1.name) == (1, "w1")
        _assert_listening(w0)
        _assert_listening(w1)
        assert placement.alive() == {"w0": True, "w1": True}

    def test_a_launch_in_place_of_a_lost_worker_takes_its_place_and_a_live_one_is_refused(
            self, placement_under_test: Placement, tmp_path: Path) -> None:
        placement = placement_under_test
        w0, w1 = placement.launch([_launch(tmp_path, "w0"), _launch(tmp_path, "w1")])
        with pytest.raises(RolloutFleetError, match=r"in_place_of=w1: .* it still runs"):
            placement.launch([attrs.evolve(_launch(tmp_path, "w2"), in_place_of="w1")])
        with pytest.raises(RolloutFleetError, match=r"in_place_of=w9: .* no worker"):
            placement.launch([attrs.evolve(_launch(tmp_path, "w2"), in_place_of="w9")])
        assert placement.alive() == {"w0": True, "w1": True}  # nothing of those started
        placement.kill("w1")
        assert wait_until(lambda: placement.alive() == {"w0": True, "w1": False}), placement.alive()
        (w2,) = placement.launch([attrs.evolve(_launch(tmp_path, "w2"), in_place_of="w1")])
        _assert_listening(w2)
        assert placement.alive() == {"w0": True, "w1": False, "w2": True}  # the lost one stays reported
        with pytest.raises(RolloutFleetError, match=r"in_place_of=w1: .* replacement already"):
            placement.launch([attrs.evolve(_launch(tmp_path, "w3"), in_place_of="w1")])
        placement.stop()
        assert wait_until(lambda: _gone(w2.pid) and _gone(w0.pid))
