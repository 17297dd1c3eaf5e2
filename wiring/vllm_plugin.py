"""vLLM's general plugin for rollout-fleet: registers the project's refit protocol with vLLM.

vLLM calls ``register`` in each of its processes (entry point group ``vllm.general_plugins``,
declared in pyproject.toml), so the weight-transfer engine factory of every worker knows the
``rollout_fleet_packed`` and ``rollout_fleet_sharded`` backends. The class itself is imported only when a worker builds it.
It also sets cuBLAS's and cuDNN's TF32 switches in every vLLM process from
``ROLLOUT_FLEET_ALLOW_TF32`` (set by the adapter, ``process_env``), before any model loads,
and, on a CPU, how long vLLM's shared-memory queue readers busy-poll after a message
(``ROLLOUT_FLEET_VLLM_BUSY_POLL_S``) before they wait on their socket.
"""

from __future__ import annotations


def register() -> None:
    """Idempotent: a process may load plugins more than once."""
    _set_tf32()
    _set_busy_poll()
    from rollout_fleet.adapters.vllm.messages import BACKEND_NAME, SHARDED_BACKEND_NAME
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in ((BACKEND_NAME, "RolloutFleetTransferEngine"),
                      (SHARDED_BACKEND_NAME, "RolloutFleetShardedTransferEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, "rollout_fleet.wiring.vllm_transfer", cls)
        except ValueError:  # registered already in this process
            pass


def _set_tf32() -> None:
    import os

    allowed = os.environ.get("ROLLOUT_FLEET_ALLOW_TF32")
    if allowed is None:
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allowed == "1"
    torch.backends.cudnn.allow_tf32 = allowed == "1"


def _set_busy_poll() -> None:
    """vLLM's queue readers spin for ``SpinCondition``'s ``busy_loop_s`` (1 s) after every
    message: a core each, on a CPU host whose cores the runtime and the driver need. The
    default of that argument is what every queue this process makes from now on takes."""
    import logging
    import os

    from rollout_fleet.adapters.vllm.messages import BUSY_POLL_ENV

    polling = os.environ.get(BUSY_POLL_ENV)
    if polling is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    wanted = (float(polling),)
    spin = getattr(shm_broadcast, "SpinCondition", None)
    defaults = getattr(getattr(spin, "__init__", None), "__defaults__", None)
    if defaults == wanted:  # set by an earlier load of the plugins
        return
    if spin is None or defaults != (1,):  # another vLLM: leave it as it is, and say so
        logging.getLogger(__name__).warning(
            "this vLLM's shared-memory queues have no busy_loop_s=1 to shorten; they poll as"
            " vLLM chose")
        return
    spin.__init__.__defaults__ = wanted
