"""SIGTERM to `serve`: while it starts the fleet, it stops what it started and exits non-zero
with one line; while it serves, it stops the fleet and exits 0. Either way no process of the
run is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.support.net import in_private_netns
from tests.cli.conftest import COMMAND, ROOT, cli_env
from tests.support.processes import leftover_processes, stop_child

pytestmark = [pytest.mark.ray, pytest.mark.dynamo]


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_sigterm_stops_everything(tmp_path, when):
    if not in_private_netns():
        pytest.fail("this test starts a local Ray cluster: run it inside `unshare -n`")
    run_dir = tmp_path / "run"
    config = tmp_path / "fleet.toml"
    config.write_text(f'num_workers = 1\nrun_dir = "{run_dir}"\n'
                      'engine = {{ kind = "memory", token_delay_s = 0.0 }}\n'.replace("{{", "{")
                      .replace("}}", "}"))
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([*COMMAND, "serve", "--config", str(config)], stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                   env=cli_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "worker-0.log").exists() if when == "starting"  # being launched
                   else "serving;" in log.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        code = process.wait(90)
    finally:
        stop_child(process)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    if when == "starting":
        assert code != 0 and "serving;" not in text, text[-3000:]
        assert "rollout-fleet serve: interrupted" in text, text[-3000:]
    else:
        assert code == 0 and text.rstrip().endswith("fleet stopped"), text[-3000:]
    assert leftover_processes([process.pid], wait_s=15) == []
    assert _processes_of_the_run(run_dir) == [], "processes of the run are left"


def _processes_of_the_run(run_dir) -> list[int]:
    """Processes whose environment names this run's discovery folder (the worker, the frontend)."""
    mark = f"DYN_FILE_KV={run_dir}/discovery".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found
