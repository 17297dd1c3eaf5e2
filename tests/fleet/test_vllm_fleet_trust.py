"""A fleet of two vLLM workers on Ray, as a user runs it: every process of it (Ray's, each
worker, vLLM's engine core and model worker, the frontend) listens on loopback only and shows
the control secret nowhere; and the shared-memory queues vLLM keeps in /dev/shm are gone once
the fleet stops, those of an engine core killed by SIGKILL included, while a segment that is
not the fleet's stays."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet
from tests.fleet.helpers import _cmdline, assert_nothing_left, fleet_ports, own_children_before
from tests.support.net import listening_sockets
from tests.support.engine_core import engine_core_of
from tests.support.trust import descendants, open_to_others, secret_leaks, shm_segments_of

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.dynamo]


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_vllm_fleet_keeps_its_secret_listens_on_loopback_and_leaves_no_shm_queues(tmp_path):
    import ray

    before = own_children_before()
    fleet = Fleet.start(parse_config({
        "engine": {"kind": "vllm"}, "num_workers": 2, "max_model_len": 256,
        "run_dir": str(tmp_path / "run"), "timeouts": {"start_s": 400}}))
    not_theirs = None
    try:
        pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
        ports = fleet_ports(fleet)
        pids = descendants(os.getpid())
        cores = {w.name: engine_core_of(w.pid).pid for w in fleet.workers}
        listeners = listening_sockets(pids)
        print("\n".join(f"{s.address}:{s.port} {_cmdline(s.pid)[:100]}" for s in listeners))
        assert [s for s in listeners if not s.is_loopback] == []
        ray_session = ray._private.worker._global_node.get_session_dir_path()
        assert secret_leaks(fleet.secret, [os.getpid(), *pids], [fleet.run_dir, ray_session]) == []
        assert open_to_others(fleet.run_dir) == []

        segments = {w.name: shm_segments_of([w.pid, *descendants(w.pid)]) for w in fleet.workers}
        assert all(segments.values()), f"no vLLM queue in /dev/shm: {segments}"
        os.kill(cores["worker-0"], signal.SIGKILL)  # its queue has no one left to remove it
        wait_gone(cores["worker-0"])
        not_theirs = Path("/dev/shm", f"psm_{os.urandom(4).hex()}")  # another program's segment
        not_theirs.write_bytes(b"not the fleet's")
    finally:
        fleet.shutdown()
    try:
        left = sorted(path for found in segments.values() for path in found if Path(path).exists())
        assert left == [], f"vLLM queues left in /dev/shm: {left}"
        assert not_theirs.read_bytes() == b"not the fleet's"
    finally:
        if not_theirs is not None:
            not_theirs.unlink(missing_ok=True)
    assert_nothing_left(pgids, ports, before)
