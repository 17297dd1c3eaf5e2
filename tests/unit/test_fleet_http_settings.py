"""The fleet's driver takes its HTTP timeouts from the config's [timeouts] section."""

from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import http_settings


def test_connect_and_request_timeouts_reach_the_drivers_client():
    config = parse_config({"engine": {"kind": "memory"},
                           "timeouts": {"connect_s": 3.5, "request_s": 42.0}})
    settings = http_settings(config, max_in_flight=17)
    assert settings.connect_timeout_s == 3.5
    assert settings.request_timeout_s == 42.0  # one attempt, in all
    assert settings.read_timeout_s == 42.0  # a read never outlasts the attempt's deadline
    assert settings.max_in_flight == 17


def test_defaults_bound_an_attempt_by_request_s():
    settings = http_settings(parse_config({"engine": {"kind": "memory"}}), max_in_flight=8)
    assert (settings.connect_timeout_s, settings.request_timeout_s) == (10.0, 600.0)
