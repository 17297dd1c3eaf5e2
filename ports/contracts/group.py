"""The engine port's contract for groups (``EnginePort.serve_group``): n samples of one prompt
in one call, sample i what ``serve_rollout`` answers with ``sample_sampling(sampling, i)``.

    class TestMyEngine(EngineContract, GroupContract):
        ...  # the same ``engine_under_test`` fixture
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout, sample_sampling
from rollout_fleet.ports.contracts.harness import EngineUnderTest

GROUP_BUDGET = 12
# Sample i served alone and inside its group may be batched differently: the same tokens, and
# logprobs equal up to the float noise of another batch shape.
LOGPROB_TOLERANCE = 1e-3


def _group(eut: EngineUnderTest, prompt: Sequence[int], n: int, sampling: SamplingSpec
           ) -> tuple[ServedRollout, ...]:
    return eut.loop.run(eut.engine.serve_group(
        list(prompt), request_id=eut.next_id(), n=n, max_new_tokens=GROUP_BUDGET,
        sampling=sampling))


class GroupContract:
    def test_a_seeded_group_is_its_samples_each_with_its_own_seed(
            self, engine_under_test: EngineUnderTest) -> None:
        eut, sampling = engine_under_test, SamplingSpec(greedy=False, temperature=1.0, seed=7)
        prompt = eut.prompts[0]
        group = _group(eut, prompt, 4, sampling)
        alone = [eut.serve(prompt, GROUP_BUDGET, sample_sampling(sampling, i)) for i in range(4)]
        assert [s.token_ids for s in group] == [s.token_ids for s in alone]
        assert len({s.token_ids for s in group}) > 1, "four seeds gave one sample: seeds unused?"
        for grouped, single in zip(group, alone):
            assert grouped.logprobs is not None and single.logprobs is not None
            assert len(grouped.logprobs) == len(grouped.token_ids)
            assert all(math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE)
                       for a, b in zip(grouped.logprobs, single.logprobs))
            assert sum(count for _, count in grouped.weight_versions) in (0, len(grouped.token_ids))
            assert grouped.usage.prompt_tokens == len(prompt)

    def test_a_greedy_group_is_the_greedy_answer_n_times(
            self, engine_under_test: EngineUnderTest) -> None:
        eut = engine_under_test
        prompt = eut.prompts[1]
        group = _group(eut, prompt, 3, SamplingSpec())
        single = eut.serve(prompt, GROUP_BUDGET)
        assert [s.token_ids for s in group] == [single.token_ids] * 3
        assert all(s.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for s in group)

    def test_an_abort_of_the_group_ends_every_sample(
            self, engine_under_test: EngineUnderTest) -> None:
        eut = engine_under_test
        prompt = list(eut.prompts[0])
        budget = eut.facts.context_length - len(prompt)
        request_id = eut.next_id()

        async def serve_then_abort() -> tuple[ServedRollout, ...]:
            task = asyncio.create_task(eut.engine.serve_group(
                prompt, request_id=request_id, n=3, max_new_tokens=budget,
                sampling=SamplingSpec(greedy=False, temperature=1.0, seed=1)))
            await asyncio.sleep(0)
            await eut.engine.abort(request_id)
            return await asyncio.wait_for(task, 120)

        group = eut.loop.run(serve_then_abort())
        assert len(group) == 3
        assert all(s.finish_reason is FinishReason.ABORT and len(s.token_ids) < budget for s in group)
        assert len(eut.serve(prompt, 4).token_ids) == 4  # the engine goes on serving
