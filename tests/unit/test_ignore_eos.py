"""ignore_eos on the rollout path: in the request, through the annotation, to the engine, for a
single rollout and for a group."""

import asyncio

import pytest

from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.adapters.memory.model import EOS_TOKEN_ID
from rollout_fleet.core.errors import AnnotationError, InvalidValue
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec
from rollout_fleet.core.wire import decode_rollout_annotation, encode_rollout_annotation
from rollout_fleet.core.worker_service import serve_annotated_rollout

BUDGET = 40
SAMPLED = SamplingSpec(greedy=False, temperature=1.0, seed=3)


def serve(engine, request):
    return asyncio.run(serve_annotated_rollout(engine, request.prompt_token_ids,
                                               encode_rollout_annotation(request)))


def test_the_annotation_carries_ignore_eos_only_when_asked():
    plain = RolloutRequest("r1", [3, 4], 8)
    assert "ignore_eos" not in encode_rollout_annotation(plain)
    asked = RolloutRequest("r2", [3, 4], 8, ignore_eos=True)
    assert decode_rollout_annotation(encode_rollout_annotation(asked)).to_request([3, 4]) == asked
    with pytest.raises(InvalidValue, match="ignore_eos=1"):
        RolloutRequest("r3", [3], 4, ignore_eos=1)
    bad = encode_rollout_annotation(plain).replace('"stop_strings":[]',
                                                   '"stop_strings":[],"ignore_eos":"yes"')
    with pytest.raises(AnnotationError, match="ignore_eos"):
        decode_rollout_annotation(bad)


def ended_at_eos(engine) -> RolloutRequest:
    """A sampled rollout that this engine ends at its end-of-sequence token within the budget."""
    for first in range(3, 200):
        request = RolloutRequest(f"free-{first}", [first, 4, 5], BUDGET, sampling=SAMPLED)
        answer = serve(engine, request)
        if answer["finish_reason"] == "stop" and answer["token_ids"][-1] == EOS_TOKEN_ID:
            return request
    raise AssertionError("no prompt of 197 ended at the end-of-sequence token")


def test_a_rollout_ignoring_eos_runs_its_whole_budget_past_the_eos():
    engine = MemoryEngine(seed=0)
    free = ended_at_eos(engine)
    ended = serve(engine, free)
    whole = serve(engine, RolloutRequest("whole", free.prompt_token_ids, BUDGET, sampling=SAMPLED,
                                         ignore_eos=True))
    assert len(whole["token_ids"]) == BUDGET and whole["finish_reason"] == "length"
    assert whole["token_ids"][:len(ended["token_ids"])] == ended["token_ids"]


def test_every_sample_of_a_group_ignoring_eos_runs_its_whole_budget():
    engine = MemoryEngine(seed=0)
    free = ended_at_eos(engine)
    group = serve(engine, RolloutRequest("group", free.prompt_token_ids, BUDGET, sampling=SAMPLED,
                                         n=4, ignore_eos=True))
    assert [len(sample["token_ids"]) for sample in group["samples"]] == [BUDGET] * 4
