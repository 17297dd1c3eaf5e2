"""Counts the heavy start-ups each test causes: vLLM engine cores, Ray clusters, Dynamo
frontends and fleet workers, seen as new processes in /proc that descend from this pytest
process (whoever started them: the test process, a CLI child, a Ray actor). Enabled with
``--startup-counts=FILE``; the table of per-test counts and times is written there as JSON at
the end of the run (under pytest-xdist, one file per worker: ``FILE.gw0`` ...), and a summary
is printed. It only observes: nothing the tests run changes."""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from collections import Counter, defaultdict

import pytest

_POLL_S = 0.25
_NAMED_WITHIN_S = 60.0  # a spawned child takes its process title (VLLM::EngineCore) late

# kind -> how its process is recognised: a substring of its command line (or name).
_KINDS = {
    "vllm_engine": ("EngineCore",),
    "ray_cluster": ("gcs_server",),
    "dynamo_frontend": ("dynamo.frontend",),
    "fleet_worker": ("rollout_fleet.wiring.worker",),
}


def _process_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            line = handle.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/comm") as handle:
            return line + " " + handle.read()
    except OSError:
        return ""


def _kind_of(line: str) -> str | None:
    for kind, marks in _KINDS.items():
        if any(mark in line for mark in marks):
            return kind
    return None


def _descends_from(pid: str, root: str) -> bool:
    import psutil

    try:
        return int(root) in {parent.pid for parent in psutil.Process(int(pid)).parents()}
    except psutil.Error:  # gone already
        return False


class StartupCounter:
    """Polls /proc and charges each new process of a known kind to the test running then."""

    def __init__(self) -> None:
        self.current = "<collection>"
        self.per_test: dict[str, Counter] = defaultdict(Counter)
        self.seconds: dict[str, float] = defaultdict(float)
        self._root = str(os.getpid())
        self._done_with = set(self._pids())  # counted, or not ours, or never named a known kind
        self._first_seen: dict[str, float] = {}
        self._born_during: dict[str, str] = {}  # pid -> the test running when it was first seen
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="startup-counts", daemon=True)

    @staticmethod
    def _pids() -> list[str]:
        return [name for name in os.listdir("/proc") if name.isdigit()]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(_POLL_S):
            self.look_now()

    def look_now(self) -> None:
        with self._lock:
            now = time.monotonic()
            for pid in self._pids():
                if pid not in self._done_with:
                    self._look_at(pid, now)

    def _look_at(self, pid: str, now: float) -> None:
        if pid not in self._first_seen:
            self._first_seen[pid] = now
            self._born_during[pid] = self.current
            if not _descends_from(pid, self._root):
                self._done_with.add(pid)
                return
        line = _process_line(pid)
        kind = _kind_of(line) if line else None
        if kind:  # charged to the test it was born in, though it takes its name later
            self.per_test[self._born_during[pid]][kind] += 1
        if kind or not line or now - self._first_seen[pid] > _NAMED_WITHIN_S:
            self._done_with.add(pid)

    def table(self) -> dict:
        tests = sorted(set(self.per_test) | set(self.seconds))
        rows = {test: {"seconds": round(self.seconds.get(test, 0.0), 1),
                       **dict(self.per_test.get(test, {}))} for test in tests}
        totals = Counter()
        for counts in self.per_test.values():
            totals.update(counts)
        return {"totals": dict(totals), "tests": rows}


def pytest_addoption(parser):
    parser.addoption("--startup-counts", default=None, metavar="FILE",
                     help="write per-test start-up counts (vLLM engines, Ray clusters, "
                          "Dynamo frontends, fleet workers) and times to FILE as JSON")


def _output_path(config) -> str:
    worker = getattr(config, "workerinput", {}).get("workerid")
    path = config.getoption("--startup-counts")
    return f"{path}.{worker}" if worker else path


def pytest_configure(config):
    xdist_controller = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
    path = config.getoption("--startup-counts")
    if path and xdist_controller:  # its workers count; an earlier run's files are not theirs
        for stale in glob.glob(glob.escape(path) + ".gw*"):
            os.remove(stale)
    if path and not xdist_controller:
        counter = StartupCounter()
        counter.start()
        config._startup_counter = counter


def _counter(config) -> StartupCounter | None:
    return getattr(config, "_startup_counter", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    counter = _counter(item.config)
    if counter is None:
        yield
        return
    counter.current = item.nodeid
    started = time.monotonic()
    yield
    counter.seconds[item.nodeid] += time.monotonic() - started
    counter.current = "<between tests>"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test outside the ``engines`` group that started a vLLM engine fails at its teardown:
    it would run beside another vLLM start (tests/conftest.py groups by the ``vllm`` mark)."""
    outcome = yield
    report, counter = outcome.get_result(), _counter(item.config)
    if counter is None or report.when != "teardown" or item.nodeid.endswith("@engines") \
            or not hasattr(item.config, "workerinput"):
        return
    counter.look_now()
    if counter.per_test[item.nodeid]["vllm_engine"]:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started a vLLM engine outside the 'engines' group: "
                           f"mark its module pytest.mark.vllm (see tests/conftest.py)")


def _write(path: str, table: dict) -> None:
    with open(path, "w") as handle:
        json.dump(table, handle, indent=1, sort_keys=True)


def _merged(paths: list[str]) -> dict:
    """The xdist workers' tables as one (their tests are disjoint)."""
    totals, tests = Counter(), {}
    for path in paths:
        with open(path) as handle:
            table = json.load(handle)
        totals.update(table["totals"])
        tests.update(table["tests"])
    return {"totals": dict(totals), "tests": tests}


def pytest_unconfigure(config):
    counter = _counter(config)
    path = config.getoption("--startup-counts")
    if counter is not None:
        counter.stop()
        _write(_output_path(config), counter.table())
    if path and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        workers = sorted(glob.glob(glob.escape(path) + ".gw*"))
        empty = {"totals": {}, "tests": {}}
        table = _merged(workers) if workers else counter.table() if counter else empty
        _write(path, table)
        print(f"\nstart-ups in this run: {table['totals']} (per test: {path})")
