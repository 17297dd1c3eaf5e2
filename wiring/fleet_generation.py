"""The driver a running fleet hands out: a NeMo-RL-shaped ``FleetGeneration`` over its
frontend and its workers' controls, with the fleet's settings (``Fleet.generation``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_fleet.adapters.http.settings import HttpSettings
from rollout_fleet.wiring.config import FleetConfig

if TYPE_CHECKING:
    from rollout_fleet.adapters.nemo_rl import FleetGeneration
    from rollout_fleet.wiring.fleet import Fleet


def fleet_generation(fleet: "Fleet", *, frontend_url: str | None = None,
                     http: HttpSettings | None = None, **overrides: Any) -> "FleetGeneration":
    """See ``Fleet.generation``."""
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.wiring.driver import build_generation

    c = fleet.config
    settings: dict[str, Any] = {
        "model": c.served_model_name, "max_model_len": c.max_model_len,
        "max_new_tokens": c.max_new_tokens, "stop_strings": tuple(c.stop_strings),
        "context_limit_policy": c.context_limit_policy, "max_in_flight": c.max_in_flight,
        "retry": c.retry.policy(), "ranks_per_worker": c.ranks_per_worker,
        "sender_spec": c.sender_spec, "control_timeout_s": c.timeouts.refit_s,
        "control_relay_width": c.refit.control_relay_width,
        "colocated_workers": tuple(c.colocated_workers), "sleep_level": c.colocation.sleep_level,
        "sleep_mode": c.colocation.sleep_mode,
    } | overrides
    return build_generation(GenerationConfig(**settings),
                            frontend_url=frontend_url or fleet.frontend_url,
                            workers=fleet.endpoints(), control_secret=fleet.secret,
                            http=http or http_settings(c, settings["max_in_flight"]),
                            lost_workers=fleet.dead_workers,
                            joined_workers=lambda: fleet.endpoints(live_only=True))


def http_settings(config: FleetConfig, max_in_flight: int) -> HttpSettings:
    """The driver's client: one connection per rollout in flight, the config's timeouts (one
    attempt may take ``attempt_fixed_s + attempt_per_token_s`` per token of its budget, never
    more than ``request_s``; a read may wait as long)."""
    t = config.timeouts
    return HttpSettings(max_in_flight=max_in_flight, connect_timeout_s=t.connect_s,
                        read_timeout_s=t.request_s, request_timeout_s=t.request_s,
                        attempt_fixed_s=t.attempt_fixed_s, attempt_per_token_s=t.attempt_per_token_s)
