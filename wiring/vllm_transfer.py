"""The weight-transfer engine vLLM's workers build for the project's refit protocol.

Composed here, where vLLM and the collective adapter meet: the packed transfer engine (the vLLM
adapter's), vLLM's base class (for vLLM's own type checks; its abstract methods differ between
vLLM versions, see ``compose_transfer_engine``), and the collective adapter's receiver as its
transfer backend (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

from rollout_fleet.adapters.collective import join_receiver
from rollout_fleet.adapters.vllm.transfer_engine import compose_transfer_engine
from vllm.distributed.weight_transfer.base import WeightTransferEngine

RolloutFleetTransferEngine = compose_transfer_engine(WeightTransferEngine, join_receiver,
                                                     module=__name__)
