"""The worker entry point as a process: SIGTERM runs Dynamo's shutdown AND the host's handler,
the process exits cleanly, unregisters its model, and leaves nothing behind."""

from __future__ import annotations

import signal
import time

import pytest

from tests.dynamo.conftest import start_worker_process, worker_config
from tests.support import free_port, group_members, leftover_processes, stop_child

pytestmark = pytest.mark.dynamo


def test_sigterm_reaches_dynamo_and_the_host_handler(fleet):
    served = "mem-sigterm"
    config = worker_config(fleet.run_dir, free_port(), served)
    worker = start_worker_process(fleet.run_dir, config, "worker-sigterm")
    try:
        fleet.frontend.wait_for_model(served, timeout_s=60, workers=[worker])
        assert group_members(worker.pid)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    finally:
        stop_child(worker)
    log = (fleet.run_dir / "worker-sigterm.log").read_text(errors="replace")
    assert "SIGTERM received" in log  # the host's own handler ran
    assert "worker: stopped" in log  # and Dynamo's shutdown let serve_worker return
    assert leftover_processes([worker.pid]) == []
    deadline = time.monotonic() + 15
    while served in fleet.frontend.listed_models() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served not in fleet.frontend.listed_models()  # it unregistered


def test_sigterm_while_starting_never_hangs(fleet):
    # A SIGTERM that lands before Dynamo installs its own handler (the worker is still importing
    # Dynamo) reaches only the worker's handler: the worker must still exit, after its grace.
    config = {**worker_config(fleet.run_dir, free_port(), "mem-early-term"),
              "sigterm_grace_s": 1}
    worker = start_worker_process(fleet.run_dir, config, "worker-early-term")
    log_path = fleet.run_dir / "worker-early-term.log"
    try:
        deadline = time.monotonic() + 30
        while "worker: starting" not in log_path.read_text(errors="replace"):
            assert worker.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.01)
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(30)  # exits one way or the other, no SIGKILL needed
    finally:
        stop_child(worker)
    log = log_path.read_text(errors="replace")
    assert "SIGTERM received" in log
    # 0: Dynamo was already up and shut down; 143: the grace ran out before Dynamo took over.
    assert (code, "exiting now" in log) in ((0, False), (128 + signal.SIGTERM, True))
    assert leftover_processes([worker.pid]) == []
