"""FleetGeneration's refit half: NeMo-RL's collective refit calls, over each worker's control
channel.

``init_collective`` and ``update_weights_from_collective`` return one future per worker at
once, because the trainer must join the same collective while the workers wait in it. With Ray
running in the driver (a fleet placed by Ray, or NeMo-RL's own), they are Ray ObjectRefs, so
``ray.get(train_futures + inference_futures)`` works as upstream (one actor makes the calls:
adapters/nemo_rl/ray_calls.py); without Ray they are
``concurrent.futures.Future`` objects (``.result()``), and an update with one body for more
workers than the coordinator's ``relay_width`` is relayed down the workers (one fan-out whose
outcome settles every worker's future). Through Ray, each worker's call is one of the actor's.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_fleet.adapters.nemo_rl.ray_calls import RayControlCalls
from rollout_fleet.core.fanout import ControlCall, relayable, run_calls, run_control_call
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo, refit_mode
from rollout_fleet.core.refit_service import RefitCoordinator, RefitDeadline
from rollout_fleet.core.staleness import StalenessGate


class FleetRefit:
    def __init__(self, coordinator: RefitCoordinator, helper: LoopThread,
                 sender_spec: CollectiveSenderSpec, gate: StalenessGate | None = None) -> None:
        self._coordinator = coordinator
        self._helper = helper
        self._spec = sender_spec
        self._gate = gate if gate is not None else StalenessGate()
        self.refit_info: RefitInfo | None = None
        self._ray_calls: RayControlCalls | None = None  # once Ray makes the calls

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list:
        plan = self._coordinator.init_collective_plan(ip, port, world_size, train_world_size,
                                                      self._spec)
        return self._launch(plan)

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any]) -> RefitInfo:
        """Every worker checks names, shapes and dtypes against its engine before any transfer."""
        info = RefitInfo.from_state_dict_info(state_dict_info)
        self._helper.run(self._coordinator.prepare_refit_info(info))
        self.refit_info = info
        return info

    def update_weights_from_collective(self, mode: str | None = None,
                                       refit_timeout_s: float | None = None) -> list:
        if self.refit_info is None:
            raise RefitError("update_weights_from_collective before prepare_refit_info")
        deadline = (None if refit_timeout_s is None
                    else RefitDeadline(refit_timeout_s, self._coordinator.worker_ids))
        checked = refit_mode(mode)  # a bad mode or a changed fleet: refused before asking any worker
        self._coordinator.check_group_current()
        version = self._helper.run(self._coordinator.next_weight_version())
        plan = self._coordinator.update_weights_plan(
            checked, weight_version=version,
            deadline_s=None if deadline is None else deadline.deadline_s)
        return self._update(plan, deadline)

    def update_weights_via_ipc_zmq(self, mode: str | None = None) -> list:
        """Every worker receives its trainer rank's IPC stream (core/ipc_stream.py); one future
        per worker, each True once that worker committed, with the versions and cache
        invalidation of every refit."""
        if self.refit_info is None:
            raise RefitError("update_weights_via_ipc_zmq before prepare_refit_info")
        checked = refit_mode(mode)  # a bad mode: refused before asking any worker
        version = self._helper.run(self._coordinator.next_weight_version())
        plan = self._coordinator.ipc_stream_plan(self.refit_info, checked, weight_version=version)
        return self._update(plan, None, true_when_done=True)

    def reload_weights(self, path: str, mode: str | None = None,
                       refit_timeout_s: float | None = None) -> dict[str, int]:
        """Every worker reloads the checkpoint folder ``path`` (``RefitCoordinator.
        reload_weights``: checked everywhere first); blocks until all did. The staleness
        bound's version advances once every worker loaded it."""
        if self._gate.bounded:
            self._gate.begin_refit(timeout_s=self._coordinator.control_timeout_s)
        loaded = False
        try:
            versions = self._helper.run(self._coordinator.reload_weights(
                path, mode=mode, deadline_s=refit_timeout_s))
            loaded = True
            return versions
        finally:
            if self._gate.bounded:
                self._gate.end_refit(loaded)

    def _update(self, plan: list[ControlCall], deadline: RefitDeadline | None, *,
                true_when_done: bool = False) -> list:
        """Launch an update's calls; the versions advance once every one succeeded."""
        if self._gate.bounded:
            # The version advances when every worker has loaded the new weights; until then
            # the rollouts admitted count as the old version's (the safe side of the bound).
            self._gate.begin_refit(timeout_s=self._coordinator.control_timeout_s)
        try:
            futures = self._launch(plan, deadline, true_when_done=true_when_done)
        except BaseException:
            self._all_loaded(False)  # none launched: a failed update
            raise
        _when_all_done(futures, self._all_loaded)
        return futures

    def _all_loaded(self, ok: bool) -> None:
        self._coordinator.updated(ok)
        if self._gate.bounded:
            self._gate.end_refit(ok)

    def weight_versions(self) -> dict[str, int]:
        return self._helper.run(self._coordinator.weight_versions())

    def _launch(self, plan: list[ControlCall], deadline: RefitDeadline | None = None, *,
                true_when_done: bool = False) -> list:
        timeout_s = self._coordinator.control_timeout_s if deadline is None else deadline.deadline_s
        if _ray_is_running():
            if self._ray_calls is None:
                self._ray_calls = RayControlCalls()
            return [self._ray_calls.submit(call, timeout_s, true_when_done=true_when_done)
                    for call in plan]
        if deadline is not None:
            return [self._helper.spawn(deadline.run(call)) for call in plan]
        if relayable(plan, self._coordinator.relay_width):
            return self._relayed(plan, timeout_s, true_when_done=true_when_done)
        if true_when_done:
            return [self._helper.spawn(_true_when_done(run_control_call(call, timeout_s)))
                    for call in plan]
        return [self._helper.spawn(run_control_call(call, timeout_s)) for call in plan]

    def _relayed(self, plan: list[ControlCall], timeout_s: float, *,
                 true_when_done: bool) -> list[concurrent.futures.Future]:
        """One fan-out relayed down the workers (core/control_relay.py); each worker's future
        ends with its own answer (True with ``true_when_done``) or its own failure."""
        whole = self._helper.spawn(run_calls(plan, timeout_s,
                                             relay_width=self._coordinator.relay_width))
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in plan]

        def settle(done: concurrent.futures.Future) -> None:
            error = done.exception()
            for call, future in zip(plan, futures):
                outcome = error if error is not None else done.result()[call.worker_id]
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(True if true_when_done else outcome)

        whole.add_done_callback(settle)
        return futures

    def close(self) -> None:
        """Stop the Ray actor that made this driver's control calls, if one was started."""
        if self._ray_calls is not None:
            self._ray_calls.close()


async def _true_when_done(answer: Any) -> bool:
    await answer
    return True


def _when_all_done(futures: Sequence[Any], callback: Callable[[bool], None]) -> None:
    """``callback(all succeeded)`` once every future (concurrent or a Ray ObjectRef) is done."""
    waiting = [f if isinstance(f, concurrent.futures.Future) else f.future() for f in futures]
    left = [len(waiting)]
    lock = threading.Lock()

    def one_done(_future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        callback(all(not f.cancelled() and f.exception() is None for f in waiting))

    if not waiting:
        callback(True)
    for future in waiting:
        future.add_done_callback(one_done)


def _ray_is_running() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()
