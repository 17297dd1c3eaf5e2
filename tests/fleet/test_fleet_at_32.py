"""A fleet of 32 memory-engine workers placed as local processes (forked from the placement's
worker template), the real Dynamo frontend and the
real driver: it serves a batch (every rollout exactly once, every worker a share), takes a real
gloo refit relayed by the workers down two trees (the tree fan-out) on every worker (each then
reports the new version and answers with the new weights), and stops leaving nothing: no
process of its groups, no port claim of its processes, no /dev/shm file its processes used.
Each phase's seconds are printed (run with -s)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from rollout_fleet.adapters.collective import TrainerRefitSession
from rollout_fleet.adapters.memory.engine import TinyBigramModel
from rollout_fleet.adapters.shared import free_port, release_ports
from rollout_fleet.adapters.shared.port_claims import default_claims_dir
from rollout_fleet.adapters.shared.shm import SharedMemoryTracker
from rollout_fleet.wiring.fleet import Fleet, call_control
from tests.driver.conftest import check_sample, engine_answers
from tests.faults.conftest import SEED, local_memory_config, mixed_batch, run
from tests.support.processes import _all_processes, leftover_processes

pytestmark = [pytest.mark.dynamo, pytest.mark.collective]
WORKERS, ROLLOUTS, MAX_NEW, MAX_LEN = 32, 1024, 16, 256


def test_32_workers_serve_refit_and_stop_leaving_nothing(tmp_path):
    seconds: dict[str, float] = {}
    claims_before = claim_files()
    leftovers = LeftoverWatch()
    clock = time.monotonic()
    fleet = Fleet.start(local_memory_config(tmp_path / "fleet", workers=WORKERS,
                                            timeouts={"start_s": 240, "refit_s": 240},
                                            refit={"fanout": "tree"}, worker_start="fork"))
    seconds["start"] = time.monotonic() - clock
    groups = fleet.process_groups()
    leftovers.start(groups)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=256)
    try:
        clock = time.monotonic()
        serve_and_check(generation, ROLLOUTS, weights_seed=SEED, batch_seed=1)
        seconds["serve"] = time.monotonic() - clock
        served = {name: call_control(url, "stats", fleet.secret)["served"]
                  for name, url in fleet.control_urls.items()}
        assert min(served.values()) > 0, f"a worker served nothing: {served}"

        clock = time.monotonic()
        assert refit(generation, seed=1) == [1] * WORKERS
        seconds["refit"] = time.monotonic() - clock
        assert generation.get_weight_versions() == {name: 1 for name in fleet.control_urls}
        serve_and_check(generation, 4 * WORKERS, weights_seed=1, batch_seed=2)
    finally:
        generation.shutdown()
        clock = time.monotonic()
        fleet.shutdown()
        seconds["stop"] = time.monotonic() - clock
        leftovers.stop()
    print(f"\n{WORKERS} workers: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    assert leftover_processes(groups, wait_s=10) == []
    left = [path for path in claim_files() - claims_before
            if claimer_pid(path) in leftovers.pids | {os.getpid()}]
    assert left == [], f"port claims left by the fleet: {left}"
    assert leftovers.shm_files_left() == []


def refit(generation, seed: int, timeout_s: float = 240.0) -> list[int]:
    """The trainer (rank 0) forms the group with every worker (each imports torch as it
    first joins) and sends the weights of ``seed``; returns the versions the workers report."""
    weights = {name: torch.tensor(matrix, dtype=torch.float32) for name, matrix
               in TinyBigramModel.from_seed(seed).state_dict().items()}
    world = 1 + generation.get_inference_world_size()
    port = free_port()
    joining = generation.init_collective("127.0.0.1", port, world, train_world_size=1)
    with TrainerRefitSession("127.0.0.1", port, 0, world, timeout_s=timeout_s,
                             spec=generation.get_collective_sender_spec()) as trainer:
        [future.result(timeout=timeout_s) for future in joining]
        info = generation.prepare_refit_info(
            {name: (tuple(t.shape), "float32") for name, t in weights.items()})
        updates = generation.update_weights_from_collective()
        trainer.send_state_dict(weights, info)
        versions = [future.result(timeout=timeout_s)["weight_version"] for future in updates]
    release_ports([port])  # this test's own claim on the group's port: the group is closed
    return versions


def serve_and_check(generation, count: int, *, weights_seed: int, batch_seed: int) -> None:
    """``count`` greedy rollouts, each exactly once and equal to the memory engine's own answer
    under the weights of ``weights_seed``: every value under the weights it started with, the
    tokens after a refit (the weights travelled as float32, so the logprobs differ in their
    last bits from those of an engine built from the seed)."""
    prompts, data = mixed_batch(count, seed=batch_seed)
    pairs = run(collect_all(generation, data))
    assert sorted(index for index, _ in pairs) == list(range(count))
    answers = engine_answers(prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                             seed=weights_seed)
    for index, sample in pairs:
        if weights_seed == SEED:
            check_sample(sample, prompts[index], answers[index])
        else:
            assert sample["output_ids"][0].tolist() == prompts[index] + list(answers[index].token_ids)


async def collect_all(generation, data):
    return [pair async for pair in generation.generate_async(data, greedy=True)]


class LeftoverWatch:
    """While the fleet runs: every process of its groups, and every /dev/shm file any process
    under this one maps or holds open that was not in use before the fleet started."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self._groups: set[int] = set()
        self._shm = SharedMemoryTracker(os.getpid(), remove_unused=False, prefix="")
        self._shm.scan()
        self._before = set(self._shm.seen.items())
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fleet-leftovers", daemon=True)

    def start(self, groups: list[int]) -> None:
        self._groups = set(groups)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            self.pids.update(pid for pid, _state, _ppid, group in _all_processes()
                             if group in self._groups)
            self._shm.scan()

    def shm_files_left(self) -> list[str]:
        made = set(self._shm.seen.items()) - self._before
        return sorted(path for path, inode in made
                      if os.path.exists(path) and os.stat(path).st_ino == inode)


def claim_files() -> set[str]:
    folder = default_claims_dir()
    return {entry.path for entry in os.scandir(folder)} if os.path.isdir(folder) else set()


def claimer_pid(path: str) -> int | None:
    try:
        with open(path) as claim:
            pid = claim.read().partition(".")[0]
    except FileNotFoundError:
        return None
    return int(pid) if pid.isdigit() else None
