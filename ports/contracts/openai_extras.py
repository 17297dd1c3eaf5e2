"""The engine port's contract for its optional ``serve_rollout`` keywords
(``ports.engine.OPTIONAL_ROLLOUT_KEYWORDS``): mix ``OpenAIExtrasContract`` into a backend's
test class beside ``EngineContract`` when its engine offers them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout
from rollout_fleet.ports.contracts.harness import GREEDY, EngineUnderTest
from rollout_fleet.ports.engine import OPTIONAL_ROLLOUT_KEYWORDS, offered_keywords

SEEDED = SamplingSpec(greedy=False, temperature=1.0, seed=1234)


class OpenAIExtrasContract:
    """Tests for engines that offer every optional ``serve_rollout`` keyword."""

    def _serve(self, eut: EngineUnderTest, prompt: Sequence[int], budget: int,
               sampling: SamplingSpec = GREEDY, **keywords: Any) -> ServedRollout:
        return eut.serve_offered(prompt, budget, sampling, **keywords)

    def test_offers_every_optional_keyword(self, engine_under_test: EngineUnderTest) -> None:
        assert offered_keywords(engine_under_test.engine) == frozenset(OPTIONAL_ROLLOUT_KEYWORDS)

    def test_top_logprobs_rank_the_alternatives_and_leave_the_tokens_alone(
            self, engine_under_test: EngineUnderTest) -> None:
        for prompt in engine_under_test.prompts[:2]:
            plain = self._serve(engine_under_test, prompt, 8)
            ranked = self._serve(engine_under_test, prompt, 8, top_logprobs=3)
            assert plain.top_logprobs is None
            assert ranked.top_logprobs is not None and ranked.logprobs is not None
            assert ranked.token_ids == plain.token_ids
            assert ranked.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
            assert len(ranked.top_logprobs) == len(ranked.token_ids)
            for token, logprob, top in zip(ranked.token_ids, ranked.logprobs, ranked.top_logprobs):
                assert len(top) == 3 and len({t for t, _ in top}) == 3
                values = [lp for _, lp in top]
                assert values == sorted(values, reverse=True)
                # Greedy: the chosen token is the most likely one.
                assert top[0][0] == token and top[0][1] == pytest.approx(logprob, abs=1e-5)

    def test_stop_token_ids_end_at_the_token_and_keep_it(
            self, engine_under_test: EngineUnderTest) -> None:
        prompt = engine_under_test.prompts[0]
        free = self._serve(engine_under_test, prompt, 12)
        stop_at = free.token_ids[min(3, len(free.token_ids) - 1)]
        stopped = self._serve(engine_under_test, prompt, 12, stop_token_ids=[stop_at])
        end = free.token_ids.index(stop_at) + 1
        assert stopped.token_ids == free.token_ids[:end]
        assert stopped.finish_reason is FinishReason.STOP

    @pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
    def test_without_logprobs_the_same_tokens_come_with_none(
            self, engine_under_test: EngineUnderTest, sampling: SamplingSpec) -> None:
        for prompt in engine_under_test.prompts[:2]:
            asked = self._serve(engine_under_test, prompt, 8, sampling)
            bare = self._serve(engine_under_test, prompt, 8, sampling, with_logprobs=False)
            assert asked.logprobs is not None and len(asked.logprobs) == len(asked.token_ids)
            assert bare.logprobs is None
            assert bare.token_ids == asked.token_ids
            assert bare.finish_reason is asked.finish_reason
            assert bare.usage == asked.usage

    def test_a_group_without_logprobs_draws_the_same_samples(
            self, engine_under_test: EngineUnderTest) -> None:
        eut = engine_under_test
        prompt = list(eut.prompts[0])

        def group(**keywords: Any) -> tuple[ServedRollout, ...]:
            return eut.loop.run(eut.engine.serve_group(
                prompt, request_id=eut.next_id(), n=3, max_new_tokens=8, sampling=SEEDED,
                **keywords))

        asked, bare = group(), group(with_logprobs=False)
        assert [s.token_ids for s in bare] == [s.token_ids for s in asked]
        assert all(s.logprobs is None for s in bare)
        assert all(s.logprobs is not None for s in asked)
