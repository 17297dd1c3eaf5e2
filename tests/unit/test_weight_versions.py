"""Per-token weight versions: the run-length values, and the memory engine tagging a rollout that
a weight load cut in two."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import (
    LocalWorkerControl, MemoryCollective, MemoryEngine, MemoryWeightSender, TinyBigramModel,
)
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit
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


def _rollout_across_a_refit(mode):
    """A 200-token greedy rollout of the memory engine, refit to other weights in ``mode``
    once it has 40 tokens; the rollout's answer and the rollout that came during the refit."""
    group = MemoryCollective()
    engine = MemoryEngine(seed=0, context_length=512, token_delay_s=0.002,
                          join_receiver=group.join_receiver)
    coordinator = RefitCoordinator([LocalWorkerControl("w0", WorkerRefit(engine).controls())])
    new = TinyBigramModel.from_seed(7)
    spec = CollectiveSenderSpec(buffer_bytes=1024, num_buffers=2)
    info = RefitInfo.from_state_dict_info({k: ((48, 8), "float32") for k in new.state_dict()})

    async def refit():
        await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 2, 1, spec))
        await coordinator.prepare_refit_info(info)
        updates = asyncio.ensure_future(coordinator.update_weights(mode=mode))
        await asyncio.to_thread(MemoryWeightSender(group, spec).send, info,
                                new.state_dict().items())
        await asyncio.sleep(0.02)  # the swap is pending (drain: waiting for the long rollout)
        late = asyncio.ensure_future(engine.serve_rollout(
            [3, 4], request_id="late", max_new_tokens=8, sampling=GREEDY))
        await updates
        return await late

    async def rollout_cut_by_a_refit():
        task = asyncio.ensure_future(engine.serve_rollout(
            [3, 4], request_id="long", max_new_tokens=200, sampling=GREEDY))
        while engine._live_tokens.get("long", 0) < 2 + 40 and not task.done():
            await asyncio.sleep(0.001)
        late = await refit()
        return await task, late

    return asyncio.run(rollout_cut_by_a_refit())


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_refit_that_keeps_rollouts_starts_a_new_run_and_the_new_weights_take_over(mode):
    old, new = TinyBigramModel.from_seed(0), TinyBigramModel.from_seed(7)  # greedy: never EOS
    served, late = _rollout_across_a_refit(mode)
    assert len(served.token_ids) == 200 and served.weight_version == 1
    (v0, before), (v1, after) = served.weight_versions
    assert (v0, v1) == (0, 1) and before >= 40 and before + after == 200
    assert list(served.token_ids[:before]) == _greedy_continuation(old, 4, before)
    assert list(served.token_ids[before:]) == _greedy_continuation(
        new, served.token_ids[before - 1], after)
    assert late.weight_versions in (((0, 8),), ((1, 8),))


def test_a_drain_refit_lets_the_rollout_finish_on_the_old_weights_and_holds_new_ones():
    old, new = TinyBigramModel.from_seed(0), TinyBigramModel.from_seed(7)
    served, late = _rollout_across_a_refit("drain")
    assert served.weight_versions == ((0, 200),)
    assert list(served.token_ids) == _greedy_continuation(old, 4, 200)
    assert late.weight_versions == ((1, 8),)  # held at the door until the swap
    assert list(late.token_ids) == _greedy_continuation(new, 4, 8)


def test_a_refit_mode_that_does_not_exist_is_refused_by_name():
    from rollout_fleet.core.refit import refit_mode

    with pytest.raises(InvalidValue) as refused:
        refit_mode("wait")
    assert refused.value.field == "mode" and "drain, keep, recompute" in str(refused.value)
