"""The per-attempt bound follows the request's token budget, within the request bound."""

import pytest

from rollout_fleet.adapters.http import HttpCompletionsTransport, HttpSettings
from rollout_fleet.core.budget import AttemptTimeout
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import completion_body
from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import http_settings


def test_the_bound_grows_with_the_budget_from_the_fixed_allowance():
    bound = AttemptTimeout(fixed_s=5.0, per_token_s=0.5)
    assert bound.bound_s(0) == 5.0
    assert bound.bound_s(10) == 10.0
    assert bound.bound_s(200) == 105.0


def test_the_bound_never_passes_the_request_bound():
    bound = AttemptTimeout(fixed_s=5.0, per_token_s=0.5, max_s=60.0)
    assert bound.bound_s(10) == 10.0
    assert bound.bound_s(10_000) == 60.0


@pytest.mark.parametrize("field,kwargs", [
    ("attempt_fixed_s", {"fixed_s": 0.0}),
    ("attempt_fixed_s", {"fixed_s": float("inf")}),
    ("attempt_per_token_s", {"per_token_s": -1.0}),
    ("request_timeout_s", {"max_s": 0.0}),
])
def test_bad_allowances_name_the_field(field, kwargs):
    with pytest.raises(InvalidValue) as caught:
        AttemptTimeout(**kwargs)
    assert caught.value.field == field


def test_a_negative_budget_is_refused_by_name():
    with pytest.raises(InvalidValue) as caught:
        AttemptTimeout().bound_s(-1)
    assert caught.value.field == "max_new_tokens"


def test_the_transport_bounds_each_attempt_by_the_bodys_budget():
    settings = HttpSettings(attempt_fixed_s=2.0, attempt_per_token_s=0.1, request_timeout_s=30.0)
    transport = HttpCompletionsTransport("http://127.0.0.1:1", settings)
    short = completion_body(RolloutRequest("a", [1], 10), "m")
    long = completion_body(RolloutRequest("b", [1], 1000), "m")
    assert transport._timeout_s(short) == pytest.approx(3.0)
    assert transport._timeout_s(long) == 30.0
    assert transport._timeout_s({"prompt": [1]}) == 30.0  # no budget: the request bound


def test_without_allowances_only_the_request_bound_applies():
    transport = HttpCompletionsTransport("http://127.0.0.1:1", HttpSettings(request_timeout_s=7.0))
    assert transport._timeout_s(completion_body(RolloutRequest("a", [1], 10), "m")) == 7.0


def test_the_fleet_config_sets_the_drivers_allowances():
    config = parse_config({"engine": {"kind": "memory"}, "placement": "local",
                           "timeouts": {"attempt_fixed_s": 4, "attempt_per_token_s": 0.05,
                                        "request_s": 100}})
    bound = http_settings(config, 8).attempt_timeout()
    assert bound == AttemptTimeout(4.0, 0.05, 100.0)
    assert bound.bound_s(64) == pytest.approx(7.2)


def test_the_hang_timeout_defaults_by_device_and_can_be_set():
    cpu = parse_config({"engine": {"kind": "memory"}, "placement": "local"})
    gpu = parse_config({"engine": {"kind": "memory"}, "placement": "local", "device": "gpu"})
    set_ = parse_config({"engine": {"kind": "memory"}, "placement": "local",
                         "timeouts": {"hang_timeout_s": 3}})
    assert cpu.hang_timeout_s > gpu.hang_timeout_s > 0
    assert set_.hang_timeout_s == 3.0
