"""The staleness bound in the driver: a trainer thread refits a real fleet (memory engines
behind the real Dynamo frontend, gloo) again and again in keep mode while another thread's
generate_async streams rollouts; no rollout falls further behind than the bound."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rollout_fleet.adapters.collective import TrainerRefitSession
from rollout_fleet.adapters.memory.engine import TinyBigramModel
from rollout_fleet.adapters.nemo_rl.batch import NO_VERSION
from rollout_fleet.adapters.shared import free_port
from tests.faults.conftest import mixed_batch

pytestmark = [pytest.mark.faults, pytest.mark.dynamo, pytest.mark.collective]
REFITS, ROLLOUTS, MAX_NEW, MAX_LEN = 6, 160, 40, 64


def spans_of(sample) -> tuple[int, int]:
    """(first, last) weight version among one sample's generated tokens."""
    versions = [v for v in sample["weight_versions"][0].tolist() if v != NO_VERSION]
    return versions[0], versions[-1]


def stream(generation, data, samples: list, errors: list) -> None:
    async def collect():
        async for _index, sample in generation.generate_async(data, greedy=True):
            samples.append(sample)
    try:
        asyncio.run(collect())
    except BaseException as exc:  # handed to the test thread
        errors.append(exc)


def refit_while(generation, streaming: threading.Thread, port: int) -> int:
    """Join the refit group, then start the stream and refit in keep mode, one refit after
    another, until the stream ends (at most REFITS). The group is formed first: a worker's
    first join loads the collective (torch), which may take longer than the whole stream."""
    world_size = 1 + generation.get_inference_world_size()
    joining = generation.init_collective("127.0.0.1", port, world_size, train_world_size=1)
    refits = 0
    with TrainerRefitSession("127.0.0.1", port, 0, world_size, timeout_s=60,
                             spec=generation.get_collective_sender_spec()) as trainer:
        for future in joining:
            future.result(timeout=60)
        streaming.start()
        while streaming.is_alive() and refits < REFITS:
            weights = {name: torch.tensor(matrix, dtype=torch.float32) for name, matrix in
                       TinyBigramModel.from_seed(refits + 1).state_dict().items()}
            info = generation.prepare_refit_info(
                {n: (tuple(t.shape), "float32") for n, t in weights.items()})
            updates = generation.update_weights_from_collective(mode="keep")  # paced by the bound
            trainer.send_state_dict(weights, info)
            for future in updates:
                future.result(timeout=60)
            refits += 1
    return refits


@pytest.mark.parametrize("bound", [0, 1])
def test_refits_under_load_never_let_a_rollout_fall_behind_the_bound(start_fleet, bound):
    fleet = start_fleet(workers=2, token_delay_s=0.004)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=32, max_staleness=bound)
    _prompts, data = mixed_batch(ROLLOUTS, seed=41, max_len=20)
    samples, errors = [], []
    streaming = threading.Thread(target=stream, args=(generation, data, samples, errors))
    try:
        refits = refit_while(generation, streaming, free_port())
        streaming.join(timeout=300)
        assert not streaming.is_alive() and errors == [], errors
        assert len(samples) == ROLLOUTS and refits >= 2  # refits really ran under the stream
        spans = [spans_of(sample) for sample in samples]
        assert max(last - first for first, last in spans) <= bound
        assert len({first for first, _ in spans}) >= 2, "every rollout ran on one version"
        if bound == 1:  # keep mode went on under rollouts: some span the switch
            assert any(last > first for first, last in spans)
        assert set(generation.get_weight_versions().values()) == {refits}
    finally:
        generation.shutdown()
