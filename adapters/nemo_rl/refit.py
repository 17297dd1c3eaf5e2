"""DynamoGeneration's refit half: NeMo-RL's collective refit calls, over each worker's control
channel.

``init_collective`` and ``update_weights_from_collective`` return one future per worker at
once, because the trainer must join the same collective while the workers wait in it. With Ray
running in the driver (a fleet placed by Ray, or NeMo-RL's own), they are Ray ObjectRefs, so
``ray.get(train_futures + inference_futures)`` works as upstream; without Ray they are
``concurrent.futures.Future`` objects (``.result()``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rollout_fleet.adapters.nemo_rl.helper_loop import HelperLoop
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.refit_service import (
    ControlCall,
    RefitCoordinator,
    run_control_call,
)


class FleetRefit:
    def __init__(self, coordinator: RefitCoordinator, helper: HelperLoop,
                 sender_spec: CollectiveSenderSpec) -> None:
        self._coordinator = coordinator
        self._helper = helper
        self._spec = sender_spec
        self.refit_info: RefitInfo | None = None

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

    def update_weights_from_collective(self, mode: str | None = None) -> list:
        if self.refit_info is None:
            raise RefitError("update_weights_from_collective before prepare_refit_info")
        return self._launch(self._coordinator.update_weights_plan(mode))

    def weight_versions(self) -> dict[str, int]:
        return self._helper.run(self._coordinator.weight_versions())

    def _launch(self, plan: list[ControlCall]) -> list:
        timeout_s = self._coordinator.control_timeout_s
        ray = _ray_if_running()
        if ray is not None:
            task = _remote_control_call(ray)
            return [task.remote(call, timeout_s) for call in plan]
        return [self._helper.spawn(run_control_call(call, timeout_s)) for call in plan]


def _ray_if_running():
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


_REMOTE = None


def _remote_control_call(ray):
    """A zero-CPU Ray task that makes one control call (its own event loop and HTTP pool)."""
    global _REMOTE
    if _REMOTE is None:
        def control_call(call: ControlCall, timeout_s: float) -> Mapping[str, Any]:
            return dict(asyncio.run(run_control_call(call, timeout_s)))

        _REMOTE = ray.remote(num_cpus=0, max_retries=0)(control_call)
    return _REMOTE
