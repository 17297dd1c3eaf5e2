"""One trainer rank of a many-source sharded refit, as a real process: joins the refit group at
its own rank (the address the fleet's ``init_collective`` was given), holds dim-0 shards of a
model folder's weights as FSDP would (norms replicated), sends them, prints what it sent.

    python -m tests.refit.sharded_trainer_proc HOST PORT WORLD_SIZE RANK TRAIN_WORLD_SIZE \
        BUFFER_BYTES NUM_BUFFERS TIMEOUT_S MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    host, port, world, rank, trainers, buffer_bytes, num_buffers, timeout_s, model = sys.argv[1:10]
    rank, trainers = int(rank), int(trainers)
    from safetensors.torch import load_file

    from rollout_fleet.adapters.collective.sharded_trainer import ShardedTrainerSession
    from rollout_fleet.adapters.collective.transfer import refit_info_of
    from rollout_fleet.core.refit import CollectiveSenderSpec, RefitProtocol
    from rollout_fleet.core.sharded_refit import TrainerLayout

    state = load_file(os.path.join(model, "model.safetensors"))
    info = refit_info_of(state)
    layout = TrainerLayout.fsdp(info, trainers, replicated=lambda meta: "norm" in meta.name)
    local = {}
    for meta, rows in zip(info.tensors, layout.rows):
        start = 0 if rows is None else sum(rows[:rank])
        local[meta.name] = state[meta.name] if rows is None else \
            state[meta.name][start:start + rows[rank]].clone()
    del state  # this rank holds only its shards from here on
    spec = CollectiveSenderSpec(protocol=RefitProtocol.SHARDED, buffer_bytes=int(buffer_bytes),
                                num_buffers=int(num_buffers))
    with ShardedTrainerSession(host, int(port), rank, int(world), train_world_size=trainers,
                               spec=spec, timeout_s=float(timeout_s)) as session:
        plan = session.send_shards(info, layout, local)
    print(json.dumps({"sent_bytes": plan.sender_bytes[rank],
                      "receiver_bytes": list(plan.receiver_bytes),
                      "fallback": [m.name for m, c in zip(info.tensors, plan.slices[0])
                                   if c.kind == "fallback"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
