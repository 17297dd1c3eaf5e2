"""The engine port's contract suite.

Usage, in a backend's own tests::

    from rollout_fleet.ports.contracts.engine import EngineContract, EngineUnderTest

    class TestMyEngine(EngineContract):
        @pytest.fixture(scope="class")
        def engine_under_test(self):
            harness = EngineUnderTest.start(lambda: MyEngine(...), decode=my_tokenizer.decode,
                                            prompts=[[1, 2, 3], [4, 5]])
            yield harness
            harness.close()

``RefitTargetContract`` (``ports/contracts/refit_target.py``) does the same for engines that
also implement the refit port.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

import pytest
from rollout_fleet.core.engine import RolloutPiece
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout
from rollout_fleet.ports.contracts.harness import GREEDY, EngineUnderTest
from rollout_fleet.ports.contracts.openai_extras import OpenAIExtrasContract
from rollout_fleet.ports.contracts.refit_target import RefitTargetContract, RefitTrainer
from rollout_fleet.ports.contracts.structured import probe_structured_outputs
from rollout_fleet.ports.engine import (
    SAMPLING_OPTIONS,
    EngineFacts,
    KvEventSource,
    streams_without_logprobs,
)

# The harness and the suites beside this one, as a backend's tests import them from here.
__all__ = ["GREEDY", "EngineContract", "EngineUnderTest", "OpenAIExtrasContract",
           "RefitTargetContract", "RefitTrainer"]


def _logprobs(served: ServedRollout) -> tuple[float, ...]:
    """The logprobs of a rollout that asked for them (the suite's always do)."""
    assert served.logprobs is not None, "a rollout asked for logprobs answered none"
    return served.logprobs


def _check_served(served: ServedRollout, budget: int) -> None:
    assert isinstance(served, ServedRollout)
    assert len(served.token_ids) == len(_logprobs(served))
    assert 1 <= len(served.token_ids) <= budget or served.finish_reason is FinishReason.ABORT
    assert all(math.isfinite(lp) and lp <= 0 for lp in _logprobs(served))
    if served.finish_reason is FinishReason.LENGTH:
        assert len(served.token_ids) == budget


class EngineContract:
    """Tests every EnginePort must pass. Provide the ``engine_under_test`` fixture."""

    def test_start_reports_real_limits(self, engine_under_test: EngineUnderTest) -> None:
        facts = engine_under_test.facts
        assert isinstance(facts, EngineFacts)
        assert facts.context_length >= 16
        assert facts.kv_block_size >= 1 and facts.total_kv_blocks >= 1 and facts.max_num_seqs >= 1

    def test_kv_cache_usage_is_a_fraction_or_unknown(
            self, engine_under_test: EngineUnderTest) -> None:
        engine_under_test.serve(engine_under_test.prompts[0], 4)
        usage = engine_under_test.engine.kv_cache_usage()
        assert usage is None or (isinstance(usage, float) and 0.0 <= usage <= 1.0), usage

    def test_progress_is_unknown_or_grows_with_each_rollout(
            self, engine_under_test: EngineUnderTest) -> None:
        engine = engine_under_test.engine
        before = engine.progress()
        engine_under_test.serve(engine_under_test.prompts[0], 4)
        after = engine.progress()
        assert (before is None and after is None) or (
            before is not None and after is not None and after > before), (before, after)

    def test_start_again_is_harmless(self, engine_under_test: EngineUnderTest) -> None:
        again = engine_under_test.loop.run(engine_under_test.engine.start(0))
        assert again == engine_under_test.facts

    def test_greedy_is_repeatable_and_well_formed(self, engine_under_test: EngineUnderTest) -> None:
        for prompt in engine_under_test.prompts:
            first = engine_under_test.serve(prompt, 12)
            second = engine_under_test.serve(prompt, 12)
            _check_served(first, 12)
            assert first.token_ids == second.token_ids
            assert first.finish_reason == second.finish_reason
            assert _logprobs(first) == pytest.approx(_logprobs(second), abs=1e-5)
            assert first.usage.prompt_tokens == len(prompt)
            assert first.usage.completion_tokens == len(first.token_ids)

    def test_budget_is_honoured(self, engine_under_test: EngineUnderTest) -> None:
        for budget in (1, 5):
            served = engine_under_test.serve(engine_under_test.prompts[0], budget)
            _check_served(served, budget)

    def test_prompts_differ_in_answers(self, engine_under_test: EngineUnderTest) -> None:
        answers = {engine_under_test.serve(p, 12).token_ids for p in engine_under_test.prompts}
        assert len(answers) > 1, "every prompt gave the same greedy answer: is the prompt used?"

    def test_seeded_sampling_repeats_and_seeds_differ(
            self, engine_under_test: EngineUnderTest) -> None:
        prompt = engine_under_test.prompts[0]
        sampled = [SamplingSpec(greedy=False, temperature=1.0, seed=seed) for seed in range(6)]
        first = [engine_under_test.serve(prompt, 16, s).token_ids for s in sampled]
        again = [engine_under_test.serve(prompt, 16, s).token_ids for s in sampled]
        assert first == again, "the same seed must give the same tokens"
        assert len(set(first)) > 1, "six seeds gave identical samples: is the seed used?"

    def test_stop_string_ends_generation_at_the_token_that_completes_it(
            self, engine_under_test: EngineUnderTest) -> None:
        prompt, free, stop = _find_stop_string_case(engine_under_test)
        stopped = engine_under_test.serve(prompt, 24, stop_strings=[stop])
        assert stopped.finish_reason is FinishReason.STOP
        n = len(stopped.token_ids)
        assert stopped.token_ids == free.token_ids[:n], "a stop string must not change the tokens before it"
        decode = engine_under_test.decode
        assert stop in decode(stopped.token_ids)
        assert stop not in decode(stopped.token_ids[:-1])

    def test_context_overflow_is_a_clear_error(self, engine_under_test: EngineUnderTest) -> None:
        prompt = list(engine_under_test.prompts[0])
        too_long = engine_under_test.facts.context_length - len(prompt) + 1
        with pytest.raises(RolloutFleetError):
            engine_under_test.serve(prompt, too_long)
        _check_served(engine_under_test.serve(prompt, 4), 4)  # and it still serves

    def test_abort_ends_an_in_flight_rollout(self, engine_under_test: EngineUnderTest) -> None:
        prompt = list(engine_under_test.prompts[0])
        budget = engine_under_test.facts.context_length - len(prompt)
        engine = engine_under_test.engine
        request_id = engine_under_test.next_id()

        async def serve_then_abort() -> ServedRollout:
            task = asyncio.create_task(engine.serve_rollout(
                prompt, request_id=request_id, max_new_tokens=budget,
                sampling=SamplingSpec(greedy=False, seed=1, temperature=1.0)))
            await asyncio.sleep(0)
            await engine.abort(request_id)
            return await asyncio.wait_for(task, 120)

        served = engine_under_test.loop.run(serve_then_abort())
        assert served.finish_reason is FinishReason.ABORT
        assert len(served.token_ids) < budget
        _check_served(engine_under_test.serve(prompt, 4), 4)  # the engine goes on serving

    def test_abort_of_an_unknown_request_is_a_no_op(
            self, engine_under_test: EngineUnderTest) -> None:
        engine_under_test.loop.run(engine_under_test.engine.abort("never-seen"))
        _check_served(engine_under_test.serve(engine_under_test.prompts[0], 4), 4)

    def test_concurrent_rollouts_all_finish(self, engine_under_test: EngineUnderTest) -> None:
        engine = engine_under_test.engine
        prompts = list(engine_under_test.prompts) * 4

        async def many() -> list[ServedRollout]:
            return await asyncio.gather(*(
                engine.serve_rollout(list(p), request_id=engine_under_test.next_id(),
                                     max_new_tokens=8, sampling=GREEDY) for p in prompts))

        results = engine_under_test.loop.run(many())
        assert len(results) == len(prompts)
        for served in results:
            _check_served(served, 8)

    def test_kv_event_sources_is_a_sequence_of_sources(
            self, engine_under_test: EngineUnderTest) -> None:
        sources = engine_under_test.engine.kv_event_sources()
        assert all(isinstance(s, KvEventSource) for s in sources)


    def test_streamed_pieces_join_to_the_served_rollout(
            self, engine_under_test: EngineUnderTest) -> None:
        engine = engine_under_test.engine
        for prompt in engine_under_test.prompts[:2]:
            whole = engine_under_test.serve(prompt, 12)

            async def pieces() -> list[RolloutPiece]:
                return [piece async for piece in engine.stream_rollout(
                    list(prompt), request_id=engine_under_test.next_id(), max_new_tokens=12,
                    sampling=GREEDY)]

            streamed = engine_under_test.loop.run(pieces())
            assert [p.finish_reason for p in streamed[:-1]] == [None] * (len(streamed) - 1)
            assert streamed[-1].finish_reason is whole.finish_reason
            assert tuple(t for p in streamed for t in p.token_ids) == whole.token_ids
            assert [lp for p in streamed for lp in p.logprobs] == pytest.approx(
                list(_logprobs(whole)), abs=1e-5)

    def test_a_stream_without_logprobs_keeps_its_tokens(
            self, engine_under_test: EngineUnderTest) -> None:
        """``with_logprobs=False`` may drop the logprobs, never change a token or the finish."""
        engine = engine_under_test.engine
        assert streams_without_logprobs(engine), "stream_rollout must take with_logprobs"
        for prompt in engine_under_test.prompts[:2]:
            whole = engine_under_test.serve(prompt, 12)

            async def pieces() -> list[RolloutPiece]:
                return [piece async for piece in engine.stream_rollout(
                    list(prompt), request_id=engine_under_test.next_id(), max_new_tokens=12,
                    sampling=GREEDY, with_logprobs=False)]

            streamed = engine_under_test.loop.run(pieces())
            assert tuple(t for p in streamed for t in p.token_ids) == whole.token_ids
            assert streamed[-1].finish_reason is whole.finish_reason
            for piece in streamed:
                assert len(piece.logprobs) in (0, len(piece.token_ids)), piece

    def test_declared_sampling_options_are_honoured(
            self, engine_under_test: EngineUnderTest) -> None:
        """Each option the engine declares changes what it generates as the option says."""
        offered = engine_under_test.engine.sampling_offered()
        assert offered <= set(SAMPLING_OPTIONS), sorted(offered - set(SAMPLING_OPTIONS))
        for name in sorted(offered):
            _SAMPLING_PROBES[name](engine_under_test)


def _a_sample_ending_early(eut: EngineUnderTest, budget: int = 32
                           ) -> tuple[Sequence[int], SamplingSpec, ServedRollout]:
    """(prompt, sampling, served) of a seeded sample that ended by itself (an end-of-sequence
    token) well before ``budget``."""
    engine = eut.engine

    async def samples(prompt: Sequence[int]) -> list[tuple[SamplingSpec, ServedRollout]]:
        specs = [SamplingSpec(greedy=False, temperature=1.0, seed=seed) for seed in range(48)]
        served = await asyncio.gather(*(engine.serve_rollout(
            list(prompt), request_id=eut.next_id(), max_new_tokens=budget, sampling=s)
            for s in specs))
        return list(zip(specs, served))

    for prompt in eut.prompts:
        for spec, served in eut.loop.run(samples(prompt)):
            if served.finish_reason is FinishReason.STOP and 2 <= len(served.token_ids) <= budget - 4:
                return prompt, spec, served
    pytest.fail("no seeded sample ended by itself early: give prompts whose samples can end")


def _probe_ignore_eos(eut: EngineUnderTest) -> None:
    prompt, sampling, ended = _a_sample_ending_early(eut)
    going_on = eut.serve_offered(prompt, 32, sampling, extra_sampling={"ignore_eos": True})
    assert going_on.finish_reason is FinishReason.LENGTH and len(going_on.token_ids) == 32
    assert going_on.token_ids[:len(ended.token_ids)] == ended.token_ids


def _probe_min_tokens(eut: EngineUnderTest) -> None:
    prompt, sampling, ended = _a_sample_ending_early(eut)
    at_least = len(ended.token_ids) + 2
    longer = eut.serve_offered(prompt, 32, sampling, extra_sampling={"min_tokens": at_least})
    assert len(longer.token_ids) >= at_least
    end_of_sequence = ended.token_ids[-1]  # no stop strings: it ended at this token
    assert end_of_sequence not in longer.token_ids[:at_least - 1]


def _probe_allowed_token_ids(eut: EngineUnderTest) -> None:
    prompt = eut.prompts[0]
    free = eut.serve(prompt, 12)
    allowed = sorted(set(eut.prompts[1]) - set(free.token_ids[:1]))[:3]
    assert allowed, "the second prompt has no token other than the first prompt's first answer"
    served = eut.serve_offered(prompt, 12, extra_sampling={"allowed_token_ids": allowed})
    assert set(served.token_ids) <= set(allowed), (served.token_ids, allowed)


def _probe_logit_bias(eut: EngineUnderTest) -> None:
    prompt = eut.prompts[0]
    favoured = eut.prompts[1][-1]
    served = eut.serve_offered(prompt, 8, extra_sampling={"logit_bias": {favoured: 100.0}})
    assert set(served.token_ids) == {favoured}, served.token_ids


def _probe_min_p(eut: EngineUnderTest) -> None:
    """min_p = 1 keeps only the most likely token: seeded samples become the greedy answer."""
    for seed, prompt in enumerate(eut.prompts[:3]):
        greedy = eut.serve(prompt, 12)
        sampling = SamplingSpec(greedy=False, temperature=1.0, seed=seed)
        held = eut.serve_offered(prompt, 12, sampling, extra_sampling={"min_p": 1.0})
        assert held.token_ids == greedy.token_ids


def _probe_penalty(name: str, value: float) -> Callable[[EngineUnderTest], None]:
    def probe(eut: EngineUnderTest) -> None:
        changed = [eut.serve_offered(p, 16, extra_sampling={name: value}).token_ids
                   != eut.serve(p, 16).token_ids for p in eut.prompts]
        assert any(changed), f"{name}={value} changed no greedy answer"
    return probe


_SAMPLING_PROBES: dict[str, Callable[[EngineUnderTest], None]] = {
    "ignore_eos": _probe_ignore_eos,
    "min_tokens": _probe_min_tokens,
    "allowed_token_ids": _probe_allowed_token_ids,
    "logit_bias": _probe_logit_bias,
    "min_p": _probe_min_p,
    "repetition_penalty": _probe_penalty("repetition_penalty", 2.0),
    "presence_penalty": _probe_penalty("presence_penalty", 2.0),
    "frequency_penalty": _probe_penalty("frequency_penalty", 2.0),
    "structured_outputs": probe_structured_outputs,
}


def _find_stop_string_case(eut: EngineUnderTest) -> tuple[Sequence[int], ServedRollout, str]:
    """A prompt whose free greedy text has a substring that first appears after token 2."""
    for prompt in eut.prompts:
        free = eut.serve(prompt, 24)
        for end in range(3, len(free.token_ids)):
            text = eut.decode(free.token_ids[:end])
            before = eut.decode(free.token_ids[:end - 1])
            for width in (1, 2, 3):
                stop = text[-width:] if len(text) >= width else ""
                if stop.strip() and stop not in before:
                    return prompt, free, stop
    pytest.fail("no prompt produced text usable for a stop-string check; give more varied prompts")

