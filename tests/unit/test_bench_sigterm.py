"""A bench stopped by SIGTERM (``timeout``'s, a job scheduler's) stops the servers it started:
they live in process groups of their own, so only the bench's ``finally`` blocks reach them.
Real processes: a bench-shaped script starts a server stand-in with the benches' ``start``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# A server stand-in that takes a second to stop, as real servers do: a second SIGTERM to the
# bench lands while it is stopping them.
SERVER = ("import signal, sys, time\n"
          "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(0)))\n"
          "time.sleep(120)")

BENCH_SHAPED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import bench_standard_clients as servers
    if sys.argv[3] == "unwind":
        servers.unwind_on_sigterm()
    running = []
    try:
        for name in ("a", "b"):
            running.append(servers.start([sys.executable, "-c", sys.argv[4]],
                                         Path(sys.argv[2]) / f"server-{name}.log"))
        time.sleep(1)  # the stand-ins' handlers are set
        print(" ".join(str(server.pid) for server in running), flush=True)
        time.sleep(120)
    finally:
        servers.stop_all(running)
""")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def killed(groups: list[int]) -> None:
    """The test's own cleanup: what outlived the bench is stopped here."""
    for pgid in groups:
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(map(group_alive, groups)) and time.monotonic() < deadline:
        time.sleep(0.1)


def terminated_bench(tmp_path: Path, mode: str, signals: int = 1) -> tuple[int, list[int]]:
    """Start the script, SIGTERM it once its servers run (a second time while it stops them,
    if ``signals`` is 2); its exit code and the servers' pids."""
    bench = subprocess.Popen([sys.executable, "-c", BENCH_SHAPED, str(BENCH), str(tmp_path),
                              mode, SERVER], stdout=subprocess.PIPE, text=True)
    server_pids = [int(pid) for pid in bench.stdout.readline().split()]
    assert len(server_pids) == 2, f"the bench did not start its servers (exit {bench.wait()})"
    bench.send_signal(signal.SIGTERM)
    if signals == 2:
        time.sleep(0.5)
        bench.send_signal(signal.SIGTERM)
    return bench.wait(timeout=60), server_pids


@pytest.mark.parametrize("signals", [1, 2], ids=["one SIGTERM", "timeout's two"])
def test_a_terminated_bench_stops_its_servers(tmp_path, signals):
    """``timeout`` signals its child and then its whole group: the second must not cut the
    stop short."""
    code, server_pids = terminated_bench(tmp_path, "unwind", signals)
    outlived = [pid for pid in server_pids if group_alive(pid)]
    killed(outlived)
    assert code == 143
    assert not outlived, f"process groups {outlived} outlived the bench"


def test_without_the_handler_the_server_would_outlive_the_bench(tmp_path):
    """The control: Python's default SIGTERM skips the finally, which is what the handler fixes."""
    code, server_pids = terminated_bench(tmp_path, "default")
    outlived = [pid for pid in server_pids if group_alive(pid)]
    killed(outlived)
    assert code == -signal.SIGTERM
    assert outlived == server_pids
