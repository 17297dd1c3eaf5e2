"""Joining an agent's turns (pure): the earlier turn's exact tokens as the prompt's prefix,
refused naming the turn where the template does not keep that turn as a prefix; named
trajectories kept bounded and forgotten when ended or idle."""

from __future__ import annotations

import pytest

from rollout_fleet.core.agent_turns import (
    RecordedTurn, Trajectories, TurnNotJoinable, TurnTokens, joined_prompt,
    recorded_turn_applies, token_fields, with_required_prefix,
)
from rollout_fleet.core.errors import InvalidValue

EOS = ("</s>", 2)
EARLIER = TurnTokens([1, 10, 11], [20, 21, 2], [-0.5, -0.25, -0.125])


def test_the_earlier_turns_tokens_are_the_prefix_and_only_the_rest_is_text():
    prefix, rest = joined_prompt(EARLIER, "<u>hi</s><a>call</s>",
                                 "<u>hi</s><a>call</s><t>sunny</s><a>", turn_field="messages[1]",
                                 end_of_turn=EOS)
    assert prefix == (1, 10, 11, 20, 21, 2)
    assert rest == "<t>sunny</s><a>"


def test_a_turn_cut_by_its_budget_gets_the_end_of_turn_the_template_writes():
    cut = TurnTokens([1, 10], [20, 21])
    prefix, _ = joined_prompt(cut, "<a>call</s>", "<a>call</s><t>x</s>", turn_field="m",
                              end_of_turn=EOS)
    assert prefix == (1, 10, 20, 21, 2)


def test_a_template_that_rewrites_the_earlier_turn_is_refused_naming_it():
    with pytest.raises(TurnNotJoinable) as refused:
        joined_prompt(EARLIER, "<a><think>why</think>call</s>", "<a>call</s><t>x</s>",
                      turn_field="messages[3]")
    assert refused.value.field == "messages[3]"
    assert "character 3" in refused.value.rule


def test_a_trajectory_continues_only_from_its_own_last_turn():
    turn = RecordedTurn(1, ("user",), EARLIER)
    assert recorded_turn_applies(turn, ["user", "assistant", "tool"], "messages") == 1
    with pytest.raises(TurnNotJoinable) as refused:
        recorded_turn_applies(turn, ["user", "user"], "messages")
    assert refused.value.field == "messages[1]" and refused.value.value == "user"
    with pytest.raises(TurnNotJoinable) as refused:
        recorded_turn_applies(turn, ["system", "assistant"], "messages")
    assert refused.value.field == "messages[:1]"


def test_trajectories_are_bounded_and_forgotten_when_ended_or_idle():
    kept = Trajectories(capacity=2, idle_s=10.0)
    turn = RecordedTurn(1, ("user",), EARLIER)
    kept.record("a", turn, now=0.0)
    kept.record("b", turn, now=1.0)
    assert kept.latest("a", now=2.0) == turn  # "a" is now the most recently used
    kept.record("a", turn, now=3.0)
    kept.record("c", turn, now=4.0)  # over capacity: the least recently used ("b") goes
    assert ("a" in kept, "b" in kept, "c" in kept) == (True, False, True)
    assert kept.end("c") and not kept.end("c")
    assert kept.latest("a", now=13.0) is None and len(kept) == 0  # idle for 10 s


def test_token_fields_of_a_message_are_checked_by_name():
    assert token_fields({"role": "assistant", "content": "x"}) is None
    both = token_fields({"prompt_token_ids": [1], "generation_token_ids": [2]})
    assert both.all_token_ids == (1, 2)
    with pytest.raises(InvalidValue) as refused:
        token_fields({"prompt_token_ids": [1, -4], "generation_token_ids": [2]})
    assert refused.value.field == "prompt_token_ids"


def test_a_required_prefix_is_the_last_assistant_turns_exact_tokens():
    roles = ["user", "assistant", "tool", "assistant", "user"]
    assert with_required_prefix({}, roles, None) == {}
    taken = with_required_prefix({}, roles, [1, 2, 3])
    assert taken == {3: TurnTokens([1, 2, 3], [])} and taken[3].all_token_ids == (1, 2, 3)
    carried = {3: TurnTokens([1, 2], [3])}
    assert with_required_prefix(carried, roles, [1, 2, 3]) == carried  # the same tokens


@pytest.mark.parametrize("roles, known, required, rule", [
    (["user", "assistant"], {}, "1 2", "must be a list of token IDs"),
    (["user", "assistant"], {}, [1, -2], "must be a list of token IDs"),
    (["user", "assistant"], {}, [1, True], "must be a list of token IDs"),
    (["user"], {}, [1, 2], "the messages have none"),
    (["user", "assistant", "user"], {1: TurnTokens([1], [2])}, [1, 2, 9],
     "differ from the 2 prompt and generated IDs messages[1] carries"),
])
def test_a_required_prefix_that_cannot_be_taken_is_refused_by_name(roles, known, required, rule):
    with pytest.raises(InvalidValue) as refused:
        with_required_prefix(known, roles, required)
    assert refused.value.field == "required_prefix_token_ids" and rule in str(refused.value)
