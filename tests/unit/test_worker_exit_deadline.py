"""The worker's stop deadline keeps its own time: a process whose event loop is stuck (here the
main thread blocked outright) still exits by the deadline once it is armed, with SIGTERM's exit
status, and arming it again does not push the deadline back."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import asyncio, sys, time
    from rollout_fleet.wiring.worker_exit import ExitDeadline

    async def main():
        deadline = ExitDeadline(float(sys.argv[1]))
        deadline.arm("a test")
        time.sleep(0.3)
        deadline.arm("a test, again")  # no later deadline
        time.sleep(60)  # the loop never runs again: only the deadline's own thread can end this
    asyncio.run(main())
""")


def test_an_armed_deadline_exits_a_process_whose_loop_is_stuck():
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", CHILD, "1.0"], capture_output=True, text=True,
                           timeout=30)
    took = time.monotonic() - started
    assert child.returncode == 143, (child.returncode, child.stderr[-2000:])
    assert "still running 1 s after a test; exiting now" in child.stderr
    assert took < 30, took  # the child's own sleep would have taken 60 s


def test_an_unarmed_deadline_leaves_the_process_alone():
    code = "from rollout_fleet.wiring.worker_exit import ExitDeadline; ExitDeadline(0.1); " \
           "import time; time.sleep(0.5); print('done')"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30)
    assert child.returncode == 0 and child.stdout.strip() == "done", child.stderr[-2000:]


HOLDS_THE_LOCK = textwrap.dedent("""
    import sys
    from rollout_fleet.wiring.worker_exit import ExitDeadline

    ExitDeadline(0.5).arm("a test")
    sys.setswitchinterval(1000)  # this thread keeps the interpreter's lock: no timer thread runs
    while True:
        pass
""")


def test_the_kernels_alarm_ends_a_process_whose_lock_no_thread_can_take():
    from rollout_fleet.wiring.worker_exit import ALARM_AFTER_DEADLINE_S

    child = subprocess.run([sys.executable, "-c", HOLDS_THE_LOCK], capture_output=True,
                           text=True, timeout=30 + ALARM_AFTER_DEADLINE_S)
    assert child.returncode == -signal.SIGALRM, (child.returncode, child.stderr[-2000:])
    assert "exiting now" not in child.stderr  # the deadline's thread never got to run
