"""The driver's refit control calls as Ray ObjectRefs, made by one long-lived actor.

NeMo-RL waits on a refit with ``ray.get(train_futures + inference_futures)``, so each worker's
control call must be a Ray future. A Ray task per call waits, whenever Ray has no idle worker
process for it (the first call, two calls at once, after Ray retired its idle workers), for a
process to start and import the driver's modules (1.1-1.7 s on an idle 2-core host:
bench/bench_refit_calls.py), all while the trainer already waits in the collective, bounded by
nothing of ours on a loaded host. One zero-CPU actor on the driver's node, started at the first
call and kept for the driver's life, answers every later call from a process already running.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from rollout_fleet.core.fanout import ControlCall, run_control_call


class ControlCallActor:
    """Runs inside Ray: each call in the actor's event loop, its HTTP client closed after."""

    def __init__(self) -> None:
        self.calls = 0

    async def call(self, call: ControlCall, timeout_s: float) -> Mapping[str, Any]:
        self.calls += 1
        try:
            return dict(await run_control_call(call, timeout_s))
        finally:
            clients = getattr(call.control, "clients", None)  # a fresh copy's, per call
            if clients is not None:
                await clients.aclose()

    async def succeeded(self, call: ControlCall, timeout_s: float) -> bool:
        """True once the call answered (NeMo-RL's IPC refit counts workers by a literal True);
        its error otherwise."""
        await self.call(call, timeout_s)
        return True

    def facts(self) -> tuple[int, int]:
        """(its process id, the calls it was given)."""
        return os.getpid(), self.calls


class RayControlCalls:
    """Submits control calls to one ``ControlCallActor``, started on first use (Ray must be
    initialized in this process); ``close`` kills it (safe to repeat)."""

    def __init__(self) -> None:
        self._actor: Any = None
        self._lock = threading.Lock()

    def submit(self, call: ControlCall, timeout_s: float, *, true_when_done: bool = False) -> Any:
        """The call's ObjectRef: its answer (``true_when_done``: True), or its error from
        ``ray.get``."""
        actor = self._running_actor()
        method = actor.succeeded if true_when_done else actor.call
        return method.remote(call, timeout_s)

    def actor_facts(self) -> tuple[int, int]:
        """The actor's (process id, calls given); starts it if none runs."""
        import ray

        pid, calls = ray.get(self._running_actor().facts.remote())
        return int(pid), int(calls)

    def close(self) -> None:
        with self._lock:
            actor, self._actor = self._actor, None
        if actor is None:
            return
        import ray

        if ray.is_initialized():
            ray.kill(actor, no_restart=True)

    def _running_actor(self) -> Any:
        with self._lock:
            if self._actor is None:
                self._actor = _start_actor()
            return self._actor


def _start_actor() -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    # Restarted if its process dies; never retried per call (a refit call is not idempotent).
    return ray.remote(ControlCallActor).options(
        num_cpus=0, max_restarts=-1, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote()
