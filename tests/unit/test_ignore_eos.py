"""ignore_eos on the rollout path, to the engine, for a single rollout and for a group (its
travel in the annotation: tests/unit/test_rollouts_without_logprobs.py)."""

from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.adapters.memory.model import EOS_TOKEN_ID
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec
from tests.support.annotated import serve_annotated as serve

BUDGET = 40
SAMPLED = SamplingSpec(greedy=False, temperature=1.0, seed=3)


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
