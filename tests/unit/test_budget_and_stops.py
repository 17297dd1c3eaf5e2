import pytest

from rollout_fleet.core.budget import ContextLimitPolicy, token_budget
from rollout_fleet.core.errors import ContextLimitExceeded, InvalidValue, TooManyStopStrings
from rollout_fleet.core.stop_strings import MAX_STOP_STRINGS, merge_stop_strings


@pytest.mark.parametrize("prompt, wanted, limit, budget", [
    (10, 5, 100, 5), (98, 5, 100, 2), (99, 5, 100, 1), (0, 7, 7, 7),
])
def test_budget_is_the_smaller_of_wanted_and_room(prompt, wanted, limit, budget):
    assert token_budget(prompt, wanted, limit) == budget


@pytest.mark.parametrize("prompt", [100, 150])
def test_full_prompt_is_rejected_by_default(prompt):
    with pytest.raises(ContextLimitExceeded) as info:
        token_budget(prompt, 5, 100)
    assert info.value.field == "prompt_len" and info.value.value == prompt
    assert "max_model_len=100" in str(info.value)


def test_full_prompt_gives_empty_generation_under_empty_policy():
    assert token_budget(100, 5, 100, ContextLimitPolicy.EMPTY) == 0
    assert token_budget(100, 5, 100, "empty") == 0


@pytest.mark.parametrize("args, field", [((-1, 5, 100), "prompt_len"), ((1, 5, 0), "max_model_len"),
                                         ((1, 5.5, 10), "max_new_tokens")])
def test_budget_refuses_bad_numbers(args, field):
    with pytest.raises(InvalidValue) as info:
        token_budget(*args)
    assert info.value.field == field


def test_stop_strings_merge_in_order_without_duplicates():
    assert merge_stop_strings(["a", "b"], ["b", "c"]) == ("a", "b", "c")
    assert merge_stop_strings(None, ["x"]) == ("x",)
    assert merge_stop_strings((), None) == ()


def test_stop_strings_cap():
    configured = [f"c{i}" for i in range(20)]
    sample = [f"s{i}" for i in range(MAX_STOP_STRINGS - 20)]
    assert len(merge_stop_strings(configured, sample)) == MAX_STOP_STRINGS
    with pytest.raises(TooManyStopStrings) as info:
        merge_stop_strings(configured, sample + ["one too many"])
    assert "33" in str(info.value) and "32" in str(info.value)


@pytest.mark.parametrize("per_sample", ["stop", [""], [3]])
def test_stop_strings_refuse_bad_entries(per_sample):
    with pytest.raises(InvalidValue):
        merge_stop_strings(["ok"], per_sample)
