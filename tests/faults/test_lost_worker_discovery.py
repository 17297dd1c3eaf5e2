"""A worker killed without a goodbye (SIGKILL: it cannot unregister) is taken out of Dynamo's
discovery by the fleet as soon as the fleet sees it lost, so the frontend stops trying it then,
not when its registration expires (with etcd, more than 25 s after a kill here: one refused
request every ~5 s meanwhile). File discovery and etcd, real frontend and workers."""

from __future__ import annotations

import base64
import json
import time
import urllib.request

import pytest

from tests.support.drills import FaultDrills
from tests.support.lost_worker import RoutingProbe, wait_until_lost

pytestmark = [pytest.mark.faults, pytest.mark.dynamo]
WATCH_AFTER_S = 12.0  # more than two of the frontend's ~5 s retries of a worker it dropped
FORGET_WITHIN_S = 15.0  # the frontend hears of a removal in well under a second when idle
IN_FLIGHT_S = 0.5  # a probe (each takes a few ms) sent before the frontend forgot the worker


@pytest.mark.parametrize("discovery", ["file", "etcd"])
def test_a_killed_worker_leaves_discovery_once_the_fleet_sees_it_lost(start_fleet, discovery,
                                                                     caplog):
    caplog.set_level("WARNING", logger="rollout_fleet.fleet")
    fleet = start_fleet(workers=2, discovery=discovery)
    instance = fleet.instance_ids["worker-0"]
    assert registered(fleet, instance)
    with RoutingProbe(fleet.frontend_url, "mem") as probe:
        probe.start()
        FaultDrills(fleet).kill_worker("worker-0")
        wait_until_lost(fleet, "worker-0")
        deadline = time.monotonic() + 10
        while registered(fleet, instance):
            assert time.monotonic() < deadline, "the lost worker is still in discovery"
            time.sleep(0.05)
        gone_at = time.monotonic()
        heard_at = wait_until_the_frontend_forgets(fleet, instance, gone_at)
        time.sleep(WATCH_AFTER_S)
    # the fleet removed it (not its registration expiring first) ...
    assert "worker-0 is lost: taken out of discovery" in caplog.text
    assert registered(fleet, fleet.instance_ids["worker-1"])  # ... and the survivor stays
    # once the frontend has dropped it (its /health; a probe already sent may still meet the
    # old route), never tried again
    assert probe.refused_after(heard_at + IN_FLIGHT_S) == []
    assert probe.served_after(heard_at + IN_FLIGHT_S) > 0


def wait_until_the_frontend_forgets(fleet, instance_id: int, gone_at: float) -> float:
    """When the frontend's own discovery stopped listing ``instance_id``: well inside the
    registration's expiry (with etcd, more than 25 s), else the fleet's removal never reached it."""
    while instance_id in fleet.frontend.known_instances():
        assert time.monotonic() - gone_at < FORGET_WITHIN_S, (
            f"the frontend still lists the lost worker {FORGET_WITHIN_S:g} s after it left discovery")
        time.sleep(0.05)
    return time.monotonic()


def registered(fleet, instance_id: int) -> bool:
    """Whether discovery still holds a key of Dynamo instance ``instance_id``."""
    hex_id = f"{instance_id:x}"
    if fleet.etcd is None:
        return any(p.name.endswith(hex_id) for p in (fleet.run_dir / "discovery").glob("v1/*/*"))
    every = base64.b64encode(b"\0").decode()
    request = urllib.request.Request(f"{fleet.etcd.endpoint}/v3/kv/range", data=json.dumps(
        {"key": every, "range_end": every, "keys_only": True}).encode())
    with urllib.request.urlopen(request, timeout=10) as answer:
        keys = [base64.b64decode(kv["key"]).decode() for kv in json.loads(answer.read()).get("kvs", [])]
    return any(key.endswith(hex_id) for key in keys)
