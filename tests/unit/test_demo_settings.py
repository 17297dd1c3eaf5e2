"""The demo's settings refuse a count it cannot run, naming the field and the value."""

import pytest

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.wiring.demo.run import DemoSettings


@pytest.mark.parametrize("field", ["steps", "prompts", "group_size", "prompt_len",
                                   "max_new_tokens", "workers"])
def test_a_count_below_one_is_refused_by_name(field):
    with pytest.raises(InvalidValue, match=f"^{field}=0: "):
        DemoSettings(**{field: 0})


def test_the_defaults_are_accepted():
    assert DemoSettings().steps >= 1
