"""How the driver's HTTP clients are sized and timed; validated up front."""

from __future__ import annotations

import math

import attrs

from rollout_fleet.core.errors import InvalidValue

# Client stacks the adapter can run on. "aiohttp" (one pooled aiohttp session, no httpx objects
# on the hot path) is the default because it measured fastest: see bench/bench_driver.py.
CLIENT_KINDS = ("aiohttp", "httpx-aiohttp", "httpx")


def _positive_int(field: str):
    def check(_i, _a, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValue(field, value, "must be an int >= 1")
    return check


def _non_negative_int(field: str):
    def check(_i, _a, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidValue(field, value, "must be an int >= 0")
    return check


def _positive_seconds(field: str):
    def check(_i, _a, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise InvalidValue(field, value, "must be a finite number of seconds > 0")
    return check


def _client_kind(_i, _a, value):
    if value not in CLIENT_KINDS:
        raise InvalidValue("http.client", value, f"must be one of {', '.join(CLIENT_KINDS)}")


@attrs.frozen
class HttpSettings:
    """Sizes and timeouts of one pooled client (one exists per event loop).

    ``max_in_flight`` is the most rollouts the driver keeps in flight; the pool holds exactly
    that many connections to the frontend (no hidden cap), plus ``extra_connections`` for
    control and metrics calls to the workers, so those never queue behind rollouts.
    """

    max_in_flight: int = attrs.field(default=256, validator=_positive_int("http.max_in_flight"))
    extra_connections: int = attrs.field(default=16,
                                         validator=_non_negative_int("http.extra_connections"))
    connect_timeout_s: float = attrs.field(default=10.0,
                                           validator=_positive_seconds("http.connect_timeout_s"))
    # A rollout answers only when its whole generation is done: minutes, not seconds.
    read_timeout_s: float = attrs.field(default=900.0,
                                        validator=_positive_seconds("http.read_timeout_s"))
    keepalive_s: float = attrs.field(default=120.0, validator=_positive_seconds("http.keepalive_s"))
    client: str = attrs.field(default="aiohttp", validator=_client_kind)

    @property
    def max_connections(self) -> int:
        return self.max_in_flight + self.extra_connections
