"""Workers forked from a local placement's worker template: what each starts with (the
template's imports, its own environment, folder, files and process group), how it ends (its
code, atexit handlers and threads, as a new interpreter's), and that nothing of the template
outlives the placement."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from rollout_fleet.adapters.local import LocalPlacement
from rollout_fleet.ports.contracts.placement import wait_until
from rollout_fleet.ports.placement import WorkerLaunch
from tests.support.processes import leftover_processes

# A module nothing else here imports: whether a worker finds it imported shows the preload.
PRELOADED = "colorsys"


def launch(tmp_path: Path, name: str, code: str, **more) -> WorkerLaunch:
    return WorkerLaunch(name=name, argv=(sys.executable, "-c", code),
                        log_path=str(tmp_path / f"{name}.log"), **more)


def log_of(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.log"
    return path.read_text() if path.exists() else ""


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


@pytest.fixture
def forking(tmp_path):
    placement = LocalPlacement(stop_grace_s=5.0, start="fork", preload=(PRELOADED,))
    yield placement
    placement.stop()


def test_a_forked_worker_starts_with_the_templates_imports_and_its_own_environment(
        forking, tmp_path):
    code = ("import os, sys, time; print('preloaded', %r in sys.modules, os.environ['MARK'], "
            "os.getcwd(), sys.argv, __name__, flush=True); time.sleep(600)" % PRELOADED)
    handles = forking.launch([launch(tmp_path, "w0", code, env={"MARK": "first"}),
                              launch(tmp_path, "w1", code, env={"MARK": "second"})])
    (template,) = forking.helper_process_groups()
    for handle, mark in zip(handles, ("first", "second")):
        want = f"preloaded True {mark} {os.getcwd()} ['-c'] __main__"
        assert wait_until(lambda: want in log_of(tmp_path, handle.name)), log_of(tmp_path, handle.name)
        assert parent_of(handle.pid) == template
        assert os.getpgid(handle.pid) == handle.pid  # a group of its own, in this session
        assert os.getsid(handle.pid) == os.getsid(0)


def test_a_module_runs_as_main_with_its_args_and_the_secret_as_its_input(forking, tmp_path):
    """``python -m json.tool`` reads the JSON handed over as the secret from its standard input
    and prints it to its log."""
    (handle,) = forking.launch([WorkerLaunch(
        name="w0", argv=(sys.executable, "-m", "json.tool", "--sort-keys"),
        log_path=str(tmp_path / "w0.log"), secret='{"b": 2, "a": 1}')])
    assert wait_until(lambda: forking.exit_status("w0") is not None)
    assert forking.exit_status("w0") == 0, log_of(tmp_path, "w0")
    assert log_of(tmp_path, "w0") == '{\n    "a": 1,\n    "b": 2\n}\n'
    assert forking.alive() == {"w0": False}


def test_a_forked_worker_ends_as_a_new_interpreter_would(forking, tmp_path):
    """Its exit code is reported; atexit handlers run and a non-daemon thread is waited for."""
    code = ("import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))"
            ").start()\n"
            "sys.exit(3)\n")
    forking.launch([launch(tmp_path, "w0", code)])
    assert wait_until(lambda: forking.exit_status("w0") is not None)
    assert forking.exit_status("w0") == 3
    assert log_of(tmp_path, "w0").splitlines() == ["thread done", "atexit ran"]


def test_a_killed_worker_reports_the_signal_and_the_others_serve_on(forking, tmp_path):
    code = "import time; print('up', flush=True); time.sleep(600)"
    handles = forking.launch([launch(tmp_path, f"w{i}", code) for i in range(2)])
    assert wait_until(lambda: all("up" in log_of(tmp_path, h.name) for h in handles))
    forking.kill("w0")
    assert forking.exit_status("w0") == -9
    assert forking.alive() == {"w0": False, "w1": True}
    (later,) = forking.launch([launch(tmp_path, "w2", code)])
    assert wait_until(lambda: "up" in log_of(tmp_path, "w2"))
    assert parent_of(later.pid) == forking.helper_process_groups()[0]


def test_stop_ends_the_workers_and_the_template(tmp_path):
    placement = LocalPlacement(stop_grace_s=5.0, start="fork", preload=(PRELOADED,))
    handles = placement.launch([launch(tmp_path, f"w{i}", "import time; time.sleep(600)")
                                for i in range(3)])
    groups = [h.pid for h in handles] + placement.helper_process_groups()
    assert len(groups) == 4
    placement.stop()
    assert leftover_processes(groups, wait_s=10) == []
    assert placement.helper_process_groups() == []
    placement.stop()  # safe to repeat


def test_a_template_whose_imports_start_a_thread_is_not_forked_from(tmp_path, caplog):
    """Forking a process with a second thread could copy a lock that thread holds: the
    placement starts each worker as a new process instead, and says why."""
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    placement = LocalPlacement(stop_grace_s=5.0, start="fork", preload=("starts_a_thread",))
    env = {"PYTHONPATH": str(tmp_path)}
    try:
        with caplog.at_level(logging.WARNING, logger="rollout_fleet.placement"):
            (handle,) = placement.launch([launch(tmp_path, "w0", "import time; time.sleep(600)",
                                                 env=env)])
        assert parent_of(handle.pid) == os.getpid()
        assert placement.helper_process_groups() == []
        assert "starting workers as new processes" in caplog.text
        assert "'threads': 2" in caplog.text
    finally:
        placement.stop()


def test_a_command_of_another_interpreter_starts_as_a_new_process(forking, tmp_path):
    (handle,) = forking.launch([WorkerLaunch(name="w0", argv=("/bin/sleep", "600"),
                                             log_path=str(tmp_path / "w0.log"))])
    assert parent_of(handle.pid) == os.getpid()
    assert forking.helper_process_groups() == []  # no template started for it


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_forked_workers_output_is_buffered_as_a_new_interpreters(forking, tmp_path, unbuffered,
                                                                    monkeypatch):
    """To a file, a new interpreter writes stdout in blocks and stderr by lines, or each write
    at once with PYTHONUNBUFFERED: a reader of the log never sees half a printed line unless
    the worker asked for that."""
    code = ("import sys; print(sys.stdout.write_through, sys.stdout.line_buffering, "
            "sys.stderr.write_through, sys.stderr.line_buffering, sep=',', flush=True)")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the launch's env says, alone
    env = {"PYTHONUNBUFFERED": unbuffered} if unbuffered else {}
    forking.launch([launch(tmp_path, "w0", code, env=env)])
    assert wait_until(lambda: forking.exit_status("w0") is not None)
    want = "True,False,True,False" if unbuffered else "False,False,False,True"
    assert log_of(tmp_path, "w0") == want + "\n"
