"""Collective adapter: a refit's tensors over torch.distributed, packed into fixed buffers.

The group is built without ``init_process_group`` (a TCPStore on loopback plus a gloo or NCCL
process group constructed directly), so a trainer's own default group is never touched.
Importing this package imports torch.
"""

from rollout_fleet.adapters.collective.group import CollectiveGroup, init_group
from rollout_fleet.adapters.collective.transfer import (
    TorchWeightReceiver,
    TorchWeightSender,
    TrainerRefitSession,
    join_receiver,
    send_state_dict,
)

__all__ = [
    "CollectiveGroup", "init_group", "TorchWeightSender", "TorchWeightReceiver",
    "TrainerRefitSession", "send_state_dict", "join_receiver",
]
