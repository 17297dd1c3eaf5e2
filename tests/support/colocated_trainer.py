"""A trainer process for colocated refits (the ``ColocatedTrainer`` of the contract suite):
the real ``ColocatedSender`` in a child process, owning its shared buffers; its control calls
come back to the test process over the child's stdin/stdout, one JSON line each way.

    python -m tests.support.colocated_trainer BUFFER_BYTES NUM_BUFFERS
    stdin:  {"state": path, "version": v, "fault": f, "fault_arg": a, "in_place": b}   one refit
            {"answer": {...}} | {"error": "..."}                        a control's answer
    stdout: {"call": name, "body": {...}}                               a control to run
            {"done": {...}} | {"failed": "..."}                         the refit's end
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rollout_fleet.ports.contracts.colocated import (
    DIE_AFTER_BUCKET, UNLINK_BEFORE_BUCKET, WRONG_SHAPE, ColocatedTrainer, TrainerDied,
)

ROOT = Path(__file__).resolve().parents[2]


class _PipeControl:
    """A WorkerControl whose calls are answered by the parent process."""

    worker_id = "parent"

    def __init__(self, fault: str | None) -> None:
        self.fault, self.buckets = fault, 0

    async def call(self, name, body, *, timeout_s=None):
        from rollout_fleet.core.errors import ControlRefused

        if name == "colocated_bucket" and self.fault == UNLINK_BEFORE_BUCKET and body["index"] == 1:
            os.unlink(f"/dev/shm/{body['handle']['name']}")
        print(json.dumps({"call": name, "body": body}), flush=True)
        reply = json.loads(await asyncio.to_thread(sys.stdin.readline))
        if "error" in reply:
            raise ControlRefused(reply["error"])
        if name == "colocated_bucket" and self.fault == DIE_AFTER_BUCKET:
            os._exit(3)
        return reply["answer"]


def main() -> int:
    import torch

    from rollout_fleet.adapters.collective.colocated_sender import ColocatedSender

    buffer_bytes, num_buffers = int(sys.argv[1]), int(sys.argv[2])
    for line in sys.stdin:
        order = json.loads(line)
        state = torch.load(order["state"])
        if order.get("fault") == WRONG_SHAPE:
            name = order["fault_arg"]
            state[name] = state[name].reshape(-1)[:-1].clone()
        control = _PipeControl(order.get("fault"))
        sender = ColocatedSender(control, buffer_bytes=buffer_bytes, num_buffers=num_buffers)
        try:
            if order.get("in_place"):  # the state's tensors move into the buffers, one a bucket
                sender.make_resident(state)
            try:
                result = sender.send(state, order.get("version"))
            finally:
                sender.close()  # its release call is answered by the parent as any other
            print(json.dumps({"done": {"weight_version": result.weight_version,
                                       "buckets": result.buckets}}), flush=True)
        except Exception as error:  # noqa: BLE001 - reported to the parent
            print(json.dumps({"failed": f"{type(error).__name__}: {error}"}), flush=True)
    return 0


class TrainerProcess:
    """The parent's end: one child for as long as it lives (a fault that kills it starts a
    new one at the next refit)."""

    def __init__(self, buffer_bytes: int, num_buffers: int) -> None:
        self.args = [str(buffer_bytes), str(num_buffers)]
        self.process: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="colocated-trainer-")

    def contract(self, buckets_per_refit: int) -> ColocatedTrainer:
        return ColocatedTrainer(refit=self.refit, buckets_per_refit=buckets_per_refit)

    def refit(self, call, tensors, version=None, fault=None, fault_arg=None, in_place=False):
        import torch

        path = os.path.join(self._dir.name, "state.pt")
        torch.save({n: t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=torch.float32)
                    for n, t in tensors.items()}, path)
        process = self._running()
        self._write({"state": path, "version": version, "fault": fault, "fault_arg": fault_arg,
                     "in_place": in_place})
        while True:
            line = process.stdout.readline()
            if not line:
                process.wait(30)
                self.process = None
                _remove_segments_of(process.pid)
                raise TrainerDied(f"the trainer process exited ({process.returncode}) mid-refit")
            message = json.loads(line)
            if "done" in message:
                return message["done"]
            if "failed" in message:
                from rollout_fleet.core.errors import RefitError

                raise RefitError(message["failed"])
            try:
                reply = {"answer": dict(call(message["call"], message["body"]))}
            except Exception as error:  # noqa: BLE001 - the trainer sees the refusal
                reply = {"error": f"{type(error).__name__}: {error}"}
            self._write(reply)

    def _running(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.colocated_trainer", *self.args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        return self.process

    def _write(self, message) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        from tests.support.processes import stop_child

        if self.process is not None:
            if self.process.poll() is None:
                self.process.stdin.close()
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            stop_child(self.process)
            self.process = None
        self._dir.cleanup()


def _remove_segments_of(pid: int) -> None:
    """What a trainer that died left in /dev/shm (a live one unlinks its own at close)."""
    from rollout_fleet.core.colocated_refit import SEGMENT_PREFIX

    for name in os.listdir("/dev/shm"):
        if name.startswith(f"{SEGMENT_PREFIX}{pid}-"):
            os.unlink(f"/dev/shm/{name}")


if __name__ == "__main__":
    sys.exit(main())
