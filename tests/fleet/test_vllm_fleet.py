"""A fleet of two real vLLM workers on Ray behind the real frontend, with ``router = "kv"``,
started once for this module, as a user runs it: prompts that share a long prefix go to the
worker that holds it (the workers publish their KV-cache events); every process of the fleet
(Ray's, each worker, vLLM's engine core and model worker, the frontend) listens on loopback
only, but for the KV-event publishers Dynamo 1.6.1 binds to every interface in each worker's
host process (documented; a memory fleet on the default router is checked strict in
tests/fleet/test_fleet_memory.py), and shows the control secret nowhere; and the shared-memory
queues vLLM keeps in /dev/shm are gone once the fleet stops, those of an engine core killed by
SIGKILL included, while a segment that is not the fleet's stays, and so are the socket files of
vLLM's ipc:// queues. The last test kills an engine core and stops the fleet."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import attrs
import httpx
import pytest

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet, call_control
from tests.fleet.helpers import _cmdline, assert_nothing_left, fleet_ports, own_children_before
from tests.support.engine_core import engine_core_of
from tests.support.net import listening_sockets, unix_socket_files
from tests.support.trust import descendants, open_to_others, secret_leaks, shm_segments_of

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.dynamo]
PREFIX_TOKENS = 300  # two full KV blocks of 128 (vLLM's CPU block size)
FOLLOW_UPS = 3  # per prefix; at random all six land right 1 time in 64, round-robin never
SETTLE_ATTEMPTS = 12  # the events reach the router within moments; bounded all the same


@attrs.frozen
class Started:
    fleet: Fleet
    children_before: set[int]  # this process's children before the fleet started


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    before = own_children_before()
    fleet = Fleet.start(parse_config({
        "engine": {"kind": "vllm"}, "router": "kv", "num_workers": 2, "max_model_len": 512,
        "run_dir": str(tmp_path_factory.mktemp("vllm-fleet") / "run"),
        "timeouts": {"start_s": 400}}))
    try:
        pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
        ports = fleet_ports(fleet)
        yield Started(fleet, before)
    finally:
        fleet.shutdown()  # the last test stops it itself; stopping again is safe
    assert_nothing_left(pgids, ports, before)  # whichever of the tests ran


@pytest.fixture
def fleet(started):  # by this name, a failed test reports each worker's log tail
    return started.fleet


def stats(fleet) -> dict[str, dict]:
    return {name: call_control(url, "stats", fleet.secret) for name, url in fleet.control_urls.items()}


def complete(fleet, prompt: list[int], pin: int | None = None) -> int:
    """One completion; returns the Dynamo instance that served it."""
    nvext = {"extra_fields": ["worker_id"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin  # Dynamo's own pin: this worker, no routing
    answer = httpx.post(f"{fleet.frontend_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "nvext": nvext})
    assert answer.status_code == 200, answer.text
    return answer.json()["nvext"]["worker_id"]["decode_worker_id"]


def fresh_prefixes(names: list[str], attempt: int) -> dict[str, list[int]]:
    """A long prefix per worker, new at every attempt (no earlier request holds it anywhere)."""
    draw = random.Random(f"prefixes {attempt}")
    return {name: [draw.randrange(3, 503) for _ in range(PREFIX_TOKENS)] for name in names}


def prefixes_the_router_knows(fleet, instance: dict[str, int]) -> dict[str, list[int]]:
    """Each worker caches a prefix of its own (pinned there); once the router has the
    workers' events, probes of each prefix go to its holder (two rounds of them, a moment
    apart: two idle workers tie, and a tie is broken at random). A probe routed elsewhere
    would leave its prefix cached on the other worker too, so a failed attempt's prefixes are
    dropped and the next attempt starts with new ones, after a longer wait."""
    for attempt in range(SETTLE_ATTEMPTS):
        prefixes = fresh_prefixes(sorted(instance), attempt)
        for name, prefix in prefixes.items():
            assert complete(fleet, prefix, pin=instance[name]) == instance[name]
        for probe in range(2):
            time.sleep(min(0.2 * 2 ** attempt, 3.0))  # the events' way to the router
            probed = {name: complete(fleet, prefix + [400, 400 + probe])
                      for name, prefix in prefixes.items()}
            if probed != instance:
                break
        else:
            print(f"the router knew both prefixes at attempt {attempt + 1}")
            return prefixes
    raise AssertionError(f"no attempt of {SETTLE_ATTEMPTS} routed both probes to their holders")


def test_prompts_sharing_a_long_prefix_go_to_the_worker_that_holds_it(fleet):
    instance = {name: s["instance_id"] for name, s in stats(fleet).items()}
    prefixes = prefixes_the_router_knows(fleet, instance)
    before_follow_ups = {name: s["served"] for name, s in stats(fleet).items()}
    routed = {name: [complete(fleet, prefix + [300 + k, 200 + k]) for k in range(FOLLOW_UPS)]
              for name, prefix in prefixes.items()}
    after = {name: s["served"] for name, s in stats(fleet).items()}
    print(f"follow-ups: {routed}")
    for name in prefixes:
        assert routed[name] == [instance[name]] * FOLLOW_UPS, (name, instance, routed)
        assert after[name] - before_follow_ups[name] == FOLLOW_UPS  # the workers' own counters


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_the_fleet_keeps_its_secret_listens_on_loopback_but_for_kv_events_and_leaves_no_queues(
        started, fleet):
    import ray

    not_theirs = None
    try:
        pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
        ports = fleet_ports(fleet)
        pids = descendants(os.getpid())
        cores = {w.name: engine_core_of(w.pid).pid for w in fleet.workers}
        listeners = listening_sockets(pids)
        print("\n".join(f"{s.address}:{s.port} {_cmdline(s.pid)[:100]}" for s in listeners))
        wide = [s for s in listeners if not s.is_loopback]
        # Dynamo 1.6.1's KV-event publishers (router = "kv") bind 0.0.0.0 whatever they are
        # told, in each worker's host process (docs/running-a-fleet.md); nothing else may.
        hosts = {w.pid for w in fleet.workers}
        assert all(s.address == "0.0.0.0" and s.pid in hosts for s in wide), wide
        ray_session = ray._private.worker._global_node.get_session_dir_path()
        assert secret_leaks(fleet.secret, [os.getpid(), *pids], [fleet.run_dir, ray_session]) == []
        assert open_to_others(fleet.run_dir) == []

        segments = {w.name: shm_segments_of([w.pid, *descendants(w.pid)]) for w in fleet.workers}
        assert all(segments.values()), f"no vLLM queue in /dev/shm: {segments}"
        ipc_files = {path for w in fleet.workers
                     for path in unix_socket_files([w.pid, *descendants(w.pid)])}
        assert ipc_files, "the workers hold no socket file (vLLM's ipc:// queues): nothing checked"
        # vLLM's own and the KV-event publishers' (named by port) in each worker's folder,
        # which its placement removes even when the worker is killed.
        assert any("rollout-fleet-kv-events-" in path for path in ipc_files), ipc_files
        assert all(Path(path).parent.name.startswith("rollout-fleet-worker-")
                   for path in ipc_files), ipc_files
        os.kill(cores["worker-0"], signal.SIGKILL)  # its queue has no one left to remove it
        wait_gone(cores["worker-0"])
        not_theirs = Path("/dev/shm", f"psm_{os.urandom(4).hex()}")  # another program's segment
        not_theirs.write_bytes(b"not the fleet's")
    finally:
        fleet.shutdown()
    try:
        left = sorted(path for found in segments.values() for path in found if Path(path).exists())
        assert left == [], f"vLLM queues left in /dev/shm: {left}"
        files_left = sorted(path for path in ipc_files if os.path.lexists(path))
        assert files_left == [], f"socket files left: {files_left}"
        assert not_theirs.read_bytes() == b"not the fleet's"
    finally:
        if not_theirs is not None:
            not_theirs.unlink(missing_ok=True)
    assert_nothing_left(pgids, ports, started.children_before)
