"""The weight-transfer engine vLLM's workers build for the project's refit protocol.

Composed here, where vLLM and the collective adapter meet: the packed transfer engine (the vLLM
adapter's), vLLM's base class (for vLLM's own type checks), and the collective adapter's
receiver as its transfer backend (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

from rollout_fleet.adapters.collective import join_receiver
from rollout_fleet.adapters.vllm.transfer_engine import PackedTransferEngine
from vllm.distributed.weight_transfer.base import WeightTransferEngine


class RolloutFleetTransferEngine(PackedTransferEngine, WeightTransferEngine):
    join_receiver = staticmethod(join_receiver)
