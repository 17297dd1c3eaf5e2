"""Token staging for NeMo-Gym's worker-owned capture (``core.token_capture.TokenStaging``): in
TransferQueue, NeMo-RL's data plane, in its staging-partition layout; and in this process's
memory. TransferQueue, torch and Ray are imported only when a TransferQueue store is used."""

from rollout_fleet.adapters.transfer_queue.memory import InMemoryStaging
from rollout_fleet.adapters.transfer_queue.store import (
    TransferQueueStaging, attach_transfer_queue, start_transfer_queue, stop_transfer_queue,
)

__all__ = ["InMemoryStaging", "TransferQueueStaging", "attach_transfer_queue",
           "start_transfer_queue", "stop_transfer_queue"]
