"""Run the ranks of one group as real processes, collect their outcomes, leave none behind.

Processes come from a 'forkserver' that imported torch once (a clean server process, no state
of the test runner in it), so each rank starts in a fraction of a second rather than paying a
torch import of its own; ``stop_forkserver`` ends the server after the tier.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from typing import Any, Callable

from rollout_fleet.adapters.shared import free_port  # noqa: F401  (the tests import it here)

# The rendezvous bound of a group a test expects to form: a loaded 2-core host (vLLM engines
# starting beside the suite) once took more than 15 s to let a thread reach its own process's
# store. Only a join that fails waits it out; tests of a join that must fail set their own.
JOIN_TIMEOUT_S = 120.0

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.collective.peers"])


def stop_forkserver() -> None:
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # joins the server process


def _child(slot: int, target: Callable, kwargs: dict, results: Any) -> None:
    results.put((slot, target(**kwargs)))


def run_ranks(ranks: list[tuple[Callable, dict]], deadline_s: float) -> list[dict | None]:
    """Start one process per (target, kwargs); wait up to ``deadline_s``; kill what is left.

    Returns each rank's outcome dict, or None for a process that reported nothing (it died or
    was still running at the deadline: the caller asserts which it expects).
    """
    results = _CTX.Queue()
    procs = [_CTX.Process(target=_child, args=(slot, target, kwargs, results), daemon=True)
             for slot, (target, kwargs) in enumerate(ranks)]
    outcomes: list[dict | None] = [None] * len(procs)
    try:
        for proc in procs:
            proc.start()
        end = time.monotonic() + deadline_s
        pending = len(procs)
        while pending and time.monotonic() < end:
            try:
                slot, outcome = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            outcomes[slot] = outcome
            pending -= 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # by its pid
            proc.join(timeout=10)
        results.close()
    assert all(not p.is_alive() for p in procs), "a rank process outlived the test"
    return outcomes
