"""A worker's controls for NeMo-RL's colocated weight stream (core/ipc_stream.py), for an
engine that takes colocated refits:

    ipc_zmq_address   where this worker connects: NeMo-RL's address of its GPU, or on the CPU
                      one of its own (the trainer rank binds it)
    ipc_zmq_update    {"refit_info"?, "weight_version"?, "mode"?, "address"?, "timeout_s"?}:
                      receive one stream into the engine; answers the committed version.
                      The refit info comes when it changed (the driver sends it once per
                      change); the worker keeps the last one, and forgets it when a stream
                      fails, so the next one carries it again

The driver's ``update_weights_via_ipc_zmq`` calls the second on every worker while the
trainer ranks stream (adapters/nemo_rl/refit.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_fleet.core.colocated_refit import CUDA_TRANSPORT
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import RefitInfo
from rollout_fleet.core.validate import is_finite_number

DEFAULT_MESSAGE_TIMEOUT_S = 120.0  # NeMo-RL's sockets wait as long for each message


def ipc_stream_controls(engine: Any, *, run_dir: str, worker_id: str) -> dict[str, Any]:
    from rollout_fleet.ports.colocated import ColocatedTarget

    if not isinstance(engine, ColocatedTarget):
        return {}
    controls = IpcStreamControls(engine, run_dir=run_dir, worker_id=worker_id)
    return {"ipc_zmq_address": controls.address, "ipc_zmq_update": controls.update}


class IpcStreamControls:
    def __init__(self, engine: Any, *, run_dir: str, worker_id: str) -> None:
        self._engine, self._run_dir, self._worker_id = engine, run_dir, worker_id
        self._gpu: str | None = None
        self._info: RefitInfo | None = None  # the last refit info an update carried

    def _gpu_uuid(self) -> str | None:
        if CUDA_TRANSPORT not in self._engine.colocated_transports():
            return None
        if self._gpu is None:
            from rollout_fleet.adapters.ipc_zmq import visible_gpu_uuid

            self._gpu = visible_gpu_uuid()
        return self._gpu

    def _address(self) -> str:
        from rollout_fleet.adapters.ipc_zmq import stream_address

        return stream_address(self._run_dir, self._worker_id, self._gpu_uuid())

    async def address(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {"address": self._address()}

    async def update(self, body: Mapping[str, Any]) -> dict[str, Any]:
        from rollout_fleet.adapters.ipc_zmq import ZmqWeightStream
        from rollout_fleet.core.ipc_stream import receive_weight_stream
        if not isinstance(body, Mapping):
            raise InvalidValue("control body", body, "must be an object")
        info = self._refit_info(body.get("refit_info"))
        address = body.get("address") or self._address()
        if not isinstance(address, str) or not address.startswith("ipc://"):
            raise InvalidValue("address", address, "must be an ipc:// address")
        timeout_s = body.get("timeout_s", DEFAULT_MESSAGE_TIMEOUT_S)
        if not is_finite_number(timeout_s) or timeout_s <= 0:
            raise InvalidValue("timeout_s", timeout_s, "must be a finite number > 0")
        gpu = self._gpu_uuid()
        try:
            async with ZmqWeightStream(address, timeout_s=timeout_s,
                                       device_uuid=gpu and gpu.removeprefix("GPU-")) as stream:
                version = await receive_weight_stream(stream, self._engine, info,
                                                      mode=body.get("mode"),
                                                      version=body.get("weight_version"))
        except BaseException:
            self._info = None  # the driver sends it again after a failed update
            raise
        return {"weight_version": version, "address": address}

    def _refit_info(self, wire: Any) -> RefitInfo:
        """The refit info an update means: the one it carries (parsed once, kept), else the
        last one kept."""
        if wire is not None:
            self._info = RefitInfo.from_wire(wire)
        elif self._info is None:
            raise InvalidValue("refit_info", None, "this worker holds none yet: the driver sends"
                               " it with the first update, and again after a failed one")
        return self._info
