"""A driver's control calls to its workers: one call, bounded by a timeout, and the fan-out to
every worker at once, failures named per worker. The refit, sleep and partial-rollout
services all send their steps this way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.control import WorkerControl
from rollout_fleet.core.errors import RefitError, WorkerFailures


@attrs.frozen
class ControlCall:
    """One control request to one worker, not yet sent (a driver may run it where it likes)."""

    control: WorkerControl
    name: str
    body: Mapping[str, Any]

    @property
    def worker_id(self) -> str:
        return self.control.worker_id


async def run_control_call(call: ControlCall, timeout_s: float) -> Mapping[str, Any]:
    """Send one control call, bounded by ``timeout_s``."""
    try:
        return await asyncio.wait_for(call.control.call(call.name, call.body, timeout_s=timeout_s),
                                      timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise RefitError(f"{call.name} on worker {call.worker_id} timed out after "
                         f"{timeout_s:g} s") from None


async def gather_workers(step: str, calls: Mapping[str, Awaitable[Any]]) -> dict[str, Any]:
    """Await every worker's call; raise WorkerFailures naming each one that failed."""
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    failures = {n: r for n, r in zip(names, results) if isinstance(r, BaseException)}
    if failures:
        raise WorkerFailures(step, failures)
    return dict(zip(names, results))


async def call_everywhere(controls: Sequence[WorkerControl], step: str, body: Mapping[str, Any],
                          timeout_s: float) -> dict[str, Any]:
    """``step`` with ``body`` on every worker of ``controls`` at once: each worker's answer,
    or WorkerFailures naming each one that failed."""
    return await gather_workers(step, {
        c.worker_id: run_control_call(ControlCall(c, step, body), timeout_s) for c in controls})
