"""The local placement stops its workers with one SIGTERM each: a second one a moment after
the first at times left Dynamo's drain in a worker hanging until the worker's own exit deadline
(15 s), so a fleet's stop took 15 s in about one stop of five."""

import sys
import time

from rollout_fleet.adapters.local import LocalPlacement
from rollout_fleet.ports.placement import WorkerLaunch

# Counts the SIGTERMs it gets (one line each) and exits 0.3 s after the first.
COUNTING_WORKER = """
import signal, sys, time
count = 0
def on_term(*_):
    global count
    count += 1
    print("SIGTERM", flush=True)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while count == 0:
    time.sleep(0.01)
time.sleep(0.3)
"""


def test_each_worker_gets_one_sigterm_and_is_waited_for(tmp_path):
    placement = LocalPlacement(stop_grace_s=5.0)
    logs = [tmp_path / f"w{i}.log" for i in range(3)]
    placement.launch([WorkerLaunch(f"w{i}", (sys.executable, "-c", COUNTING_WORKER),
                                   log_path=str(log)) for i, log in enumerate(logs)])
    deadline = time.monotonic() + 30
    while not all(log.exists() and "ready" in log.read_text() for log in logs):
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    started = time.monotonic()
    placement.stop()
    assert time.monotonic() - started < 4.0  # they exit by themselves; nothing waits for a kill
    assert [log.read_text().count("SIGTERM") for log in logs] == [1, 1, 1]


def test_a_worker_deaf_to_sigterm_is_killed_at_the_grace(tmp_path):
    placement = LocalPlacement(stop_grace_s=1.0)
    deaf = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    log = tmp_path / "deaf.log"
    placement.launch([WorkerLaunch("deaf", (sys.executable, "-c", deaf), log_path=str(log))])
    while not (log.exists() and "ready" in log.read_text()):
        time.sleep(0.05)
    started = time.monotonic()
    placement.stop()
    assert 0.9 < time.monotonic() - started < 5.0
    assert placement.alive() == {}
