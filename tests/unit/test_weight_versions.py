"""Per-token weight versions: the run-length values, and the memory engine tagging a rollout that
a weight load cut in two."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import MemoryEngine, TinyBigramModel
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import (
    GREEDY, RolloutResult, ServedRollout, Usage, join_version_runs,
)


def test_runs_default_to_the_whole_rollout_at_its_version():
    served = ServedRollout((1, 2, 3), (-0.1,) * 3, "stop", Usage(2, 3), weight_version=4)
    assert served.weight_versions == ((4, 3),)
    assert RolloutResult.from_served("r", served).weight_versions == ((4, 3),)
    untagged = ServedRollout((1,), (-0.1,), "stop", Usage(2, 1))
    assert untagged.weight_versions == ()
    empty = ServedRollout((), (), "abort", Usage(2, 0), weight_version=4)
    assert empty.weight_versions == ()


def test_adjacent_runs_of_one_version_merge():
    served = ServedRollout((1, 2, 3), (-0.1,) * 3, "stop", Usage(2, 3), weight_version=5,
                           weight_versions=[[4, 1], [4, 1], [5, 1]])
    assert served.weight_versions == ((4, 2), (5, 1))
    assert join_version_runs(((1, 2), (2, 3)), ((2, 1), (3, 4))) == ((1, 2), (2, 4), (3, 4))


def test_runs_must_tag_every_token_once():
    with pytest.raises(InvalidValue, match="3 tagged, 2 generated"):
        ServedRollout((1, 2), (-0.1,) * 2, "stop", Usage(2, 2), weight_versions=[[0, 3]])
    with pytest.raises(InvalidValue, match=r"weight_versions\[1\]\[1\]"):
        RolloutResult("r", (1, 2), (-0.1,) * 2, "stop", weight_versions=[[0, 2], [1, 0]])


def _greedy_continuation(model: TinyBigramModel, prev: int, n: int) -> list[int]:
    tokens = []
    for _ in range(n):
        row = model.logprobs_after(prev)
        prev = max(range(len(row)), key=row.__getitem__)
        tokens.append(prev)
    return tokens


def test_a_load_mid_rollout_starts_a_new_run_and_the_new_weights_take_over():
    engine = MemoryEngine(seed=0, context_length=512, token_delay_s=0.002)
    old, new = TinyBigramModel.from_seed(0), TinyBigramModel.from_seed(7)  # greedy: never EOS

    async def rollout_cut_by_a_load():
        task = asyncio.ensure_future(engine.serve_rollout(
            [3, 4], request_id="long", max_new_tokens=200, sampling=GREEDY))
        while engine._live_tokens.get("long", 0) < 2 + 40 and not task.done():
            await asyncio.sleep(0.001)
        await engine.load_weights(new.state_dict().items())
        return await task

    served = asyncio.run(rollout_cut_by_a_load())
    assert len(served.token_ids) == 200 and served.weight_version == 1
    (v0, before), (v1, after) = served.weight_versions
    assert (v0, v1) == (0, 1) and before >= 40 and before + after == 200
    assert list(served.token_ids[:before]) == _greedy_continuation(old, 4, before)
    assert list(served.token_ids[before:]) == _greedy_continuation(
        new, served.token_ids[before - 1], after)
