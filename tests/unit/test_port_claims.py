"""Ports handed out by one process are not handed out by another until the first is gone: the
placement choosing a worker's system port and a worker choosing its inner one probe the same
range, and a port is free to a probe until its user binds it. Real processes, a real claims
folder, real sockets on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from rollout_fleet.adapters.shared.net import PORT_RANGE, free_port
from rollout_fleet.adapters.shared.port_claims import CLAIMS_DIR_ENV, PortClaims

# Ten ports nothing else in the test namespace takes: above the fleet's range (tests beside
# these ones claim ports there) and above the kernel's ephemeral range (client sockets).
RANGE = (61000, 61009)
CLAIMER = f"""
import sys
from rollout_fleet.adapters.shared.net import free_port
print(*sorted(free_port(port_range={RANGE}) for _ in range(5)), flush=True)
sys.stdin.readline()  # hold the claims until told to exit
"""


def test_the_test_range_is_one_nothing_else_takes():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_high = int(ranges.read().split()[1])
    assert RANGE[0] > max(PORT_RANGE[1], ephemeral_high), (
        f"the port-claim tests' range {RANGE} overlaps the fleet's {PORT_RANGE} or the kernel's"
        f" ephemeral ports (up to {ephemeral_high}): move it above both")


def start_claimer(folder) -> tuple[subprocess.Popen, set[int]]:
    child = subprocess.Popen([sys.executable, "-c", CLAIMER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, CLAIMS_DIR_ENV: str(folder)})
    return child, {int(port) for port in child.stdout.readline().split()}


def test_another_process_never_gets_a_port_a_live_one_was_handed(tmp_path):
    folder = tmp_path / "claims"
    child, theirs = start_claimer(folder)
    try:
        assert len(theirs) == 5  # none of them bound: a probe alone would hand them out again
        claims = PortClaims(str(folder))
        mine = {free_port(port_range=RANGE, claims=claims) for _ in range(5)}
        assert mine.isdisjoint(theirs) and len(mine) == 5
        with pytest.raises(OSError, match=f"no free port in {RANGE[0]}-{RANGE[1]}"):
            free_port(port_range=RANGE, claims=claims)
    finally:
        child.communicate("exit\n", timeout=30)
    assert child.returncode == 0
    # Its claims went with it (released at exit): their ports are free to claim again.
    assert {free_port(port_range=RANGE, claims=claims) for _ in range(5)} == theirs


def test_the_claims_of_a_killed_process_lapse(tmp_path):
    folder = tmp_path / "claims"
    child, theirs = start_claimer(folder)
    child.send_signal(signal.SIGKILL)  # no exit handler runs: its claim files stay
    child.wait()
    child.stdin.close()
    child.stdout.close()
    assert {int(name) for name in os.listdir(folder)} == theirs
    claims = PortClaims(str(folder))
    taken = {free_port(port_range=RANGE, claims=claims) for _ in range(10)}
    assert taken == set(range(RANGE[0], RANGE[1] + 1))  # the dead one's five among them


def test_a_claim_from_another_pid_namespace_holds_until_its_time_runs_out(tmp_path):
    claims = PortClaims(str(tmp_path), ttl_s=60)
    assert claims.claim(24100)  # makes the folder
    foreign = tmp_path / "24101"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    foreign.write_text(f"{gone}.1")  # a dead pid, but of a namespace (inode 1) not this one
    assert not claims.claim(24101)
    old = time.time() - 61
    os.utime(foreign, (old, old))
    assert claims.claim(24101)
    assert not claims.claim(24100)  # this process's own claim holds against itself too
    claims.release(24100)
    assert claims.claim(24100)


def test_a_bound_port_is_never_handed_out(tmp_path):
    import socket

    claims = PortClaims(str(tmp_path))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        with pytest.raises(OSError, match=f"no free port in {port}-{port}"):
            free_port(port_range=(port, port), claims=claims)


def test_a_claims_folder_others_can_write_is_refused_by_name(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(OSError, match=f"'{folder}'.*0700.*{CLAIMS_DIR_ENV}"):
        PortClaims(str(folder)).claim(24100)


def test_a_forked_child_leaving_does_not_release_its_parents_claims(tmp_path):
    claims = PortClaims(str(tmp_path))
    assert claims.claim(24100)
    child = os.fork()
    if child == 0:  # what the child's exit handlers would run
        claims.release_mine()
        claims.release(24100)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "24100").exists() and not claims.claim(24100)
    claims.release_mine()
    assert not (tmp_path / "24100").exists()
