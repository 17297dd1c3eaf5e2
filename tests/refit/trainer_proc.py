"""A real trainer process for the refit tests: joins the refit group as rank 0 and sends state
dicts on command (one line on stdin each), answering one line on stdout.

    python -m tests.refit.trainer_proc HOST PORT WORLD_SIZE BUFFER_BYTES NUM_BUFFERS TIMEOUT_S
    stdin:  "send <model_dir>"            send that folder's weights
            "send-and-die <model_dir> <n>" exit abruptly after handing over n tensors
            "quit"
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    host, port, world_size, buffer_bytes, num_buffers, timeout_s = sys.argv[1:7]
    from safetensors.torch import load_file

    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.collective.transfer import refit_info_of
    from rollout_fleet.core.refit import CollectiveSenderSpec

    spec = CollectiveSenderSpec(buffer_bytes=int(buffer_bytes), num_buffers=int(num_buffers))
    session = TrainerRefitSession(host, int(port), 0, int(world_size), spec=spec,
                                  timeout_s=float(timeout_s))
    print("joined", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        state = load_file(os.path.join(words[1], "model.safetensors"))
        info = refit_info_of(state)
        if words[0] == "send-and-die":
            session.send_state_dict(_dying_after(state, int(words[2])), info)
        else:
            session.send_state_dict(state, info)
        print("sent", flush=True)
    session.close()
    return 0


def _dying_after(state, n):
    """The state dict's tensors, handed over one by one; the process ends after ``n``."""
    for index, item in enumerate(state.items()):
        if index == n:
            os._exit(3)
        yield item


if __name__ == "__main__":
    sys.exit(main())
