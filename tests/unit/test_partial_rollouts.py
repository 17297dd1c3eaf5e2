"""Partial rollouts over the memory engine: cut mid-way, continued, joined = the uncut rollout."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import EngineCompletionsTransport, MemoryEngine
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.partial import continuation_request, join_rollouts
from rollout_fleet.core.rollout import FinishReason, RolloutRequest, RolloutResult
from rollout_fleet.core.rollout_client import RolloutClient

REQUEST = RolloutRequest("cut-me", (3, 4), 120)


def _client(engine):
    return RolloutClient(EngineCompletionsTransport(engine), model="memory")


def test_a_cut_rollout_continued_equals_the_uncut_one_token_for_token():
    engine = MemoryEngine(seed=0, context_length=512, token_delay_s=0.002)
    client = _client(engine)

    async def cut_then_continue():
        uncut = await client.rollout(RolloutRequest("whole", REQUEST.prompt_token_ids, 120))
        task = asyncio.ensure_future(client.rollout(REQUEST))
        while engine._live_tokens.get("cut-me", 0) < 2 + 30 and not task.done():
            await asyncio.sleep(0.001)
        await engine.abort("cut-me")
        partial = await task
        return uncut, partial, await client.continue_rollout(REQUEST, partial)

    uncut, partial, joined = asyncio.run(cut_then_continue())
    assert partial.finish_reason is FinishReason.ABORT
    assert 30 <= len(partial.token_ids) < 120
    assert joined.token_ids == uncut.token_ids and joined.logprobs == uncut.logprobs
    assert joined.finish_reason is uncut.finish_reason is FinishReason.LENGTH
    assert joined.weight_versions == ((0, 120),)
    assert joined.request_id == "cut-me" and joined.attempts == 2
    assert engine.served_count == 3


def test_the_continuation_carries_prompt_and_tokens_with_the_budget_left():
    partial = RolloutResult("r", (7, 8), (-0.1, -0.2), "abort", weight_version=1)
    follow = continuation_request(REQUEST, partial)
    assert follow.prompt_token_ids == (3, 4, 7, 8)
    assert follow.max_new_tokens == 118 and follow.request_id == "cut-me+2"
    assert follow.sampling == REQUEST.sampling


@pytest.mark.parametrize("partial, field", [
    (RolloutResult("r", (7,), (-0.1,), "stop"), "partial.finish_reason"),
    (RolloutResult("r", (7,) * 120, (-0.1,) * 120, "abort"), "partial.token_ids"),
])
def test_only_an_aborted_rollout_with_budget_left_is_continued(partial, field):
    with pytest.raises(InvalidValue) as refused:
        continuation_request(REQUEST, partial)
    assert refused.value.field == field


def test_joining_keeps_both_parts_versions_in_order():
    first = RolloutResult("r", (1, 2), (-0.1, -0.2), "abort", weight_version=3)
    rest = RolloutResult("r+2", (5, 6, 7), (-0.3,) * 3, "stop", weight_version=4,
                         weight_versions=[[3, 1], [4, 2]])
    joined = join_rollouts(first, rest)
    assert joined.token_ids == (1, 2, 5, 6, 7) and joined.finish_reason is FinishReason.STOP
    assert joined.weight_versions == ((3, 3), (4, 2)) and joined.weight_version == 4
