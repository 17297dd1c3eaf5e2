"""A trainer process colocated with one worker of a running fleet (on the CPU: the same host):
it refits that worker through its control routes with the real ``ColocatedSender``.

    python -m tests.refit.colocated_trainer_proc BUFFER_BYTES NUM_BUFFERS
    stdin, first line: {"worker": id, "url": control URL, "secret": the fleet's secret}
           then:       "send <model_dir>" | "send-wrong-shape <model_dir> <tensor>"
                       | "resident <model_dir>" (its tensors made resident, then sent in place)
                       | "step <model_dir>" (the resident tensors overwritten in place with that
                         model's values, as an optimizer steps, then sent) | "quit"
    stdout: one JSON line per command: the result, or {"error": "..."}
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    from safetensors.torch import load_file

    from rollout_fleet.wiring.colocated_trainer import colocated_sender, control_at

    buffer_bytes, num_buffers = int(sys.argv[1]), int(sys.argv[2])
    reach = json.loads(sys.stdin.readline())  # the secret comes on stdin, never argv or env
    control = control_at(reach["worker"], reach["url"], reach["secret"])
    resident: dict = {}  # the tensors held in place, once made resident
    with colocated_sender(control, buffer_bytes=buffer_bytes, num_buffers=num_buffers,
                          timeout_s=120) as sender:
        print(json.dumps({"ready": os.getpid()}), flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            state = load_file(os.path.join(words[1], "model.safetensors"))
            if words[0] == "send-wrong-shape":
                state[words[2]] = state[words[2]][:-1].clone()
            try:
                state = in_place(sender, words[0], state, resident)
                result = sender.send(state)
                print(json.dumps({"weight_version": result.weight_version, "buckets": result.buckets,
                                  "pool_bytes": result.pool_bytes, "nbytes": result.nbytes,
                                  "seconds": result.seconds, "engine": dict(result.engine),
                                  "moved_tensors": result.moved_tensors}), flush=True)
            except Exception as error:  # noqa: BLE001 - the test reads the refusal
                print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
    return 0


def in_place(sender, command: str, state: dict, resident: dict) -> dict:
    """What to send: ``state`` itself, or the resident tensors (made so, or stepped in place)."""
    if command == "resident":
        resident.update(state)
        sender.make_resident(resident)
        return resident
    if command == "step":
        for name, tensor in resident.items():
            tensor.copy_(state[name])  # in place: the tensor stays where the sender put it
        return resident
    return state


if __name__ == "__main__":
    sys.exit(main())
