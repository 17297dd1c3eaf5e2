"""The weight-transfer engine vLLM's workers build for the project's refit protocol.

Composed here, where vLLM and the collective adapter meet: the packed transfer engine (the vLLM
adapter's), vLLM's base class (for vLLM's own type checks; its abstract methods differ between
vLLM versions, see ``compose_transfer_engine``), and the collective adapter's receiver as its
transfer backend (gloo on CPUs, NCCL on GPUs) and its buffer opener for colocated refits; and
the same for the sharded protocol's engine with the collective adapter's sharded receiver.
"""

from __future__ import annotations

from rollout_fleet.adapters.collective import join_receiver
from rollout_fleet.adapters.collective.colocated import open_buffer
from rollout_fleet.adapters.collective.sharded_trainer import join_sharded_receiver
from rollout_fleet.adapters.vllm.inside.colocated_engine import compose_colocated_engine
from rollout_fleet.adapters.vllm.inside.sharded_transfer_engine import ShardedTransferEngine
from rollout_fleet.adapters.vllm.inside.transfer_engine import compose_transfer_engine
from vllm.distributed.weight_transfer.base import WeightTransferEngine

# The packed engine, which also takes colocated refits (the trainer's shared buffers opened
# with the collective adapter's ``open_buffer``).
RolloutFleetTransferEngine = compose_colocated_engine(WeightTransferEngine, join_receiver,
                                                      open_buffer, module=__name__)
# The many-source sharded protocol: every rank of the group a data rank, slices received.
RolloutFleetShardedTransferEngine = compose_transfer_engine(
    WeightTransferEngine, join_sharded_receiver, module=__name__,
    name="RolloutFleetShardedTransferEngine", engine=ShardedTransferEngine)
