"""How the driver's HTTP clients are sized and timed; validated up front."""

from __future__ import annotations

from typing import Any

import attrs
from rollout_fleet.core.budget import AttemptTimeout
from rollout_fleet.core.rollout_client import DEFAULT_MAX_IN_FLIGHT
from rollout_fleet.core.validate import Vocabulary, finite_at_least, int_at_least, positive_int


class ClientKind(Vocabulary):
    """The client stack the adapter runs on, spelt as a caller writes it (``client="httpx"``).
    AIOHTTP (one pooled aiohttp session, no httpx objects on the hot path) is the default
    because it measured fastest: see bench/bench_driver.py."""

    AIOHTTP = "aiohttp"
    HTTPX_AIOHTTP = "httpx-aiohttp"  # httpx's API over httpx-aiohttp's transport
    HTTPX = "httpx"  # httpx on its own transport


CLIENT_KINDS = tuple(kind.value for kind in ClientKind)


def _client_kind(value: Any) -> ClientKind:
    return ClientKind.parse(value, "http.client")


@attrs.frozen
class HttpSettings:
    """Sizes and timeouts of one pooled client (one exists per event loop).

    ``max_in_flight`` is the most rollouts the driver keeps in flight; the pool holds exactly
    that many connections to the frontend (no hidden cap), plus ``extra_connections`` for
    control and metrics calls to the workers, so those never queue behind rollouts.
    """

    max_in_flight: int = attrs.field(default=DEFAULT_MAX_IN_FLIGHT,
                                     validator=positive_int("http.max_in_flight"))
    extra_connections: int = attrs.field(default=16,
                                         validator=int_at_least("http.extra_connections", 0))
    connect_timeout_s: float = attrs.field(default=10.0,
                                           validator=finite_at_least("http.connect_timeout_s", strictly=True))
    # A rollout answers only when its whole generation is done: minutes, not seconds. A rollout
    # POST takes it as one deadline on its answer; control and metrics GETs, as a bound on each
    # socket read.
    read_timeout_s: float = attrs.field(default=900.0,
                                        validator=finite_at_least("http.read_timeout_s", strictly=True))
    # The longest one rollout attempt may take, connect to last byte (None: no total deadline,
    # only the connect and read bounds); past it the attempt is a transport error (retried).
    request_timeout_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(
            finite_at_least("http.request_timeout_s", strictly=True)))
    # The per-attempt bound that follows the request: ``attempt_fixed_s + attempt_per_token_s *
    # max_tokens`` (never above request_timeout_s), so a worker that hangs unseen costs about
    # that, not the whole request_timeout_s. None (either): only request_timeout_s bounds it.
    attempt_fixed_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(
            finite_at_least("http.attempt_fixed_s", strictly=True)))
    attempt_per_token_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(
            finite_at_least("http.attempt_per_token_s")))
    keepalive_s: float = attrs.field(default=120.0, validator=finite_at_least("http.keepalive_s", strictly=True))
    client: ClientKind = attrs.field(default=ClientKind.AIOHTTP,
                                     converter=_client_kind)

    @property
    def max_connections(self) -> int:
        return self.max_in_flight + self.extra_connections

    def attempt_timeout(self) -> AttemptTimeout | None:
        """The per-attempt bound of a rollout, when both allowances are set."""
        if self.attempt_fixed_s is None or self.attempt_per_token_s is None:
            return None
        return AttemptTimeout(self.attempt_fixed_s, self.attempt_per_token_s,
                              self.request_timeout_s)
