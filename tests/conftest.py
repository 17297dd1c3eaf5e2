"""Suite-wide: no file in /dev/shm that a process of this test run mapped or held open is left
when the run ends (vLLM's queues, psm_*, ~160-240 MiB each, and multiprocessing's named
semaphores, sem.mp-*, are the ones that leaked; staging files would be caught the same way).
A failed test that used a fleet reports the tail of each worker's log beside its traceback."""

from __future__ import annotations

import gc
import os
import re
import threading
from pathlib import Path

import pytest

from rollout_fleet.adapters.shared.shm import SharedMemoryTracker

from tests.support.worker_network import release, take_own_network

_SCAN_EVERY_S = 2.0

pytest_plugins = ["tests.support.startup_counts"]

_TESTS = Path(__file__).parent
# What starts vLLM engines runs one test at a time, on one pytest-xdist worker (group "engines"):
# two vLLM starts at once would only share the same cores. Every other module is a group of its
# own, so its module- and session-scoped fixtures start once, on the worker that takes it; Ray
# clusters and frontends may run on both workers at once, each worker in a network namespace of
# its own (tests/support/worker_network.py).
_ENGINE_TIERS = {"refit", "vllm"}


def engines_group(item) -> str:
    """Read as the test is collected, before the tiers' own collection hooks add marks: their
    rule (every test of tests/refit and tests/vllm starts or shares a vLLM engine) is repeated
    here; elsewhere a module that starts one carries the ``vllm`` mark."""
    tier = Path(str(item.path)).relative_to(_TESTS).parts[0]
    if tier in _ENGINE_TIERS or item.get_closest_marker("vllm") is not None:
        return "engines"
    return str(Path(str(item.path)).relative_to(_TESTS))


def pytest_itemcollected(item):  # as each is collected: before pytest-xdist reads the groups
    item.add_marker(pytest.mark.xdist_group(engines_group(item)))


# The engines group is the run's critical path, and vLLM's CPU processes run at nice 10
# (VllmEngineConfig.cpu_worker_nice): the tests beside it, and what they start, run at that nice
# too, so they share the cores with vLLM's processes instead of going first.
BESIDE_ENGINES_NICE = 10


@pytest.hookimpl(tryfirst=True)  # before its fixtures start anything
def pytest_runtest_setup(item):
    if getattr(item.config, "workerinput", None) is None:
        return
    wanted = 0 if item.nodeid.endswith("@engines") else BESIDE_ENGINES_NICE
    if os.getpriority(os.PRIO_PROCESS, 0) != wanted:
        try:  # this thread (Linux: nice is per thread) and what it starts from now on
            os.setpriority(os.PRIO_PROCESS, 0, wanted)
        except PermissionError:  # back to 0 needs root (CAP_SYS_NICE): then it stays lower
            pass


def pytest_configure(config):
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:
        config._ray_folder = take_own_network(worker)


def pytest_unconfigure(config):
    if getattr(config, "_ray_folder", None):
        release(config._ray_folder)


@pytest.fixture(scope="session", autouse=True)
def _no_shared_memory_left_behind():
    # Record only: what the fleet and the engines remove themselves is what is checked.
    tracker = SharedMemoryTracker(os.getpid(), remove_unused=False, prefix="")
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_SCAN_EVERY_S):
            tracker.scan()

    thread = threading.Thread(target=watch, name="suite-shm-watch", daemon=True)
    thread.start()
    yield
    done.set()
    thread.join()
    gc.collect()  # a dropped multiprocessing object's semaphore goes with it
    # A semaphore that this live process still holds is not left: its exit removes it.
    held = {path for path in tracker.in_use() if os.path.basename(path).startswith("sem.")}
    held |= {path for path in tracker.seen if _named_after_this_process(path)}
    left = tracker.remove_all(keep=held)  # removed now, so one failed run litters nothing
    assert left == [], f"segments processes of this run used were left in /dev/shm: {left}"


def _named_after_this_process(path: str) -> bool:
    """Where this process is a trainer rank producing CUDA IPC handles (the GPU tier): torch's
    reference-count file and the CUDA driver's IPC file, both named after it and removed by its
    exit (removing them earlier makes torch abort at exit)."""
    name, pid = os.path.basename(path), os.getpid()
    if name.startswith(f"torch_{pid}_"):
        return True
    parts = name.split(".")  # cuda.shm.<device>.<pid in hex>.<n>
    return name.startswith("cuda.shm.") and len(parts) > 3 and parts[3] == f"{pid:x}"


_LOG_TAIL_BYTES = 8_000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    fleet = getattr(item, "funcargs", {}).get("fleet")
    if report.when != "call" or not report.failed or not hasattr(fleet, "workers"):
        return
    from rollout_fleet.adapters.shared.processes import read_tail

    frontend = getattr(fleet, "frontend", None)  # what it answered, and why, is in its log
    logs = [*((getattr(w, "name", None), getattr(w, "log_path", None)) for w in fleet.workers),
            ("frontend", getattr(frontend, "log_path", None))]
    for name, log_path in logs:
        if log_path:
            report.sections.append((f"{name or log_path} log, last {_LOG_TAIL_BYTES} bytes",
                                    read_tail(log_path, _LOG_TAIL_BYTES)))
    routing = _routing_events(getattr(frontend, "log_path", None))
    if routing:
        report.sections.append(("frontend's routing and discovery events", routing))


# What the frontend logs when it takes a worker out of routing or discovery changes (at the
# levels tests/refit/conftest.py's ROUTING_LOG asks for), and its 503s.
_ROUTING_EVENT = re.compile(r"instance .* down|inhibit|Expired|[Rr]emov|not ready|status=503"
                            r"|[Ww]orker set|no instances")


def _routing_events(log_path, most: int = 200) -> str:
    if not log_path or not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as log:
        lines = [line for line in log if _ROUTING_EVENT.search(line)]
    return "".join(lines[-most:])
