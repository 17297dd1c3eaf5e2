"""The benches' per-round CPU reading (bench/process_load.py), on real processes: a child
that burns a known amount of CPU in its main thread, one that sleeps, and this process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from process_load import leaders_of, load_between, load_line, snapshot  # noqa: E402

from rollout_fleet.adapters.shared.processes import stop_process_group  # noqa: E402

# Waits for a line, burns 0.5 s of CPU in its main thread, says so, then sleeps until stopped.
BURNER = """
import sys, time
sys.stdin.readline()
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(600)
"""


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def burn_own_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_round_names_the_process_that_burnt_cpu_and_its_busy_thread():
    burner, sleeper = child(BURNER), child("import time; time.sleep(600)")
    try:
        leaders = leaders_of([burner]) + [os.getpid()]
        before = snapshot(leaders)
        burner.stdin.write("go\n")
        burner.stdin.flush()
        assert burner.stdout.readline().strip() == "burnt"
        burn_own_cpu(0.2)
        rows = {row["pid"]: row for row in load_between(before, snapshot(leaders))}
    finally:
        for process in (burner, sleeper):
            stop_process_group(process, timeout_s=10)
    assert sleeper.pid not in rows  # not a leader's group: not read
    burnt = rows[burner.pid]
    assert burnt["cpu_s"] >= 0.45, burnt
    assert burnt["process"].startswith("python -c"), burnt
    # Its main thread did the burning: named as the process is, and no thread can be busier
    # than its whole process (beyond what two reads of the kernel's 10 ms ticks can differ).
    assert burnt["busiest_thread"] == Path(sys.executable).name[:15], burnt
    assert 0 < burnt["busiest_thread_share"] <= burnt["cores"] + 0.05, burnt
    assert rows[os.getpid()]["cpu_s"] >= 0.15  # this process: its own PID was named
    assert f"{burnt['process']}" in load_line(list(rows.values()))


def test_this_process_is_not_read_unless_named():
    before = snapshot([])
    burn_own_cpu(0.1)
    assert load_between(before, snapshot([])) == []


def test_this_process_is_read_with_its_own_children_but_not_the_servers_it_started_apart():
    burner = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # in this process's group
    server = child("import time; time.sleep(600)")  # a session of its own, as a server's
    try:
        before = snapshot([os.getpid()])
        burner.stdin.write("go\n")
        burner.stdin.flush()
        assert burner.stdout.readline().strip() == "burnt"
        read = snapshot([os.getpid()])["processes"]
    finally:
        burner.kill()
        burner.wait()
        stop_process_group(server, timeout_s=10)
    assert burner.pid in read and server.pid not in read
    rows = {row["pid"]: row for row in load_between(before, {"t": time.monotonic(),
                                                             "processes": read})}
    assert rows[burner.pid]["cpu_s"] >= 0.45
