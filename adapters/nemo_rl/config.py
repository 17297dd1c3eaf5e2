"""What the driver needs to know to fit and send rollouts; validated up front."""

from __future__ import annotations

from typing import Any

import attrs
from rollout_fleet.core.budget import ContextLimitPolicy
from rollout_fleet.core.control_relay import DEFAULT_RELAY_WIDTH, check_relay_width
from rollout_fleet.core.refit import CollectiveSenderSpec
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.rollout_client import DEFAULT_MAX_IN_FLIGHT
from rollout_fleet.core.rollout import GREEDY, SamplingSpec
from rollout_fleet.core.sleep_state import DEFAULT_SLEEP_LEVEL, DEFAULT_SLEEP_MODE, sleep_level, sleep_mode
from rollout_fleet.core.stop_strings import merge_stop_strings
from rollout_fleet.core.validate import finite_at_least, int_at_least, non_empty_str, positive_int


_RENAMED = {"max_concurrency": "max_in_flight"}  # old field name -> its name now


@attrs.frozen(init=False)
class GenerationConfig:
    """The generation side of a driver: model, budgets, sampling, concurrency, refit geometry."""

    model: str = attrs.field(validator=non_empty_str("model"))  # the served model name
    max_model_len: int = attrs.field(validator=positive_int("max_model_len"))
    max_new_tokens: int = attrs.field(validator=positive_int("max_new_tokens"))
    stop_strings: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    context_limit_policy: ContextLimitPolicy = attrs.field(default=ContextLimitPolicy.REJECT,
                                                           converter=ContextLimitPolicy)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None  # a base seed: each rollout samples with seed + its number
    # Rollouts in flight at once, across every generate_async call on one event loop.
    max_in_flight: int = attrs.field(default=DEFAULT_MAX_IN_FLIGHT,
                                     validator=positive_int("max_in_flight"))
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    ranks_per_worker: int = attrs.field(default=1, validator=positive_int("ranks_per_worker"))
    sender_spec: CollectiveSenderSpec = attrs.field(factory=CollectiveSenderSpec)
    control_timeout_s: float = attrs.field(default=600.0, validator=finite_at_least("control_timeout_s", strictly=True))
    # A refit step for more workers than this is relayed down a tree of them
    # (core/control_relay.py); 0: the driver calls every worker.
    control_relay_width: int = attrs.field(default=DEFAULT_RELAY_WIDTH, converter=check_relay_width)
    # Asynchronous RL: how many refits behind the newest weights a rollout in flight may fall
    # (core/staleness.py); the driver paces admissions and refits to keep it. None: no bound.
    max_staleness: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least("max_staleness", 0)))
    # > 0: sample every worker's metrics this often while the driver lives; 0: only on demand.
    metrics_interval_s: float = attrs.field(default=0.0, validator=finite_at_least("metrics_interval_s"))
    # Colocated RL: the workers that share devices with trainer ranks; they sleep at
    # finish_generation (at this level and mode, core/sleep.py) and wake at prepare_for_generation.
    colocated_workers: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    sleep_level: int = attrs.field(default=DEFAULT_SLEEP_LEVEL, converter=sleep_level)
    sleep_mode: str = attrs.field(default=DEFAULT_SLEEP_MODE, converter=sleep_mode)

    def __init__(self, *args: Any, **fields: Any) -> None:
        for old, new in _RENAMED.items():
            if old in fields:
                raise InvalidValue(old, fields[old], f"renamed: use {new} (the rollouts one "
                                   "driver keeps in flight, as in the fleet config)")
        self.__attrs_init__(*args, **fields)

    def __attrs_post_init__(self) -> None:
        merge_stop_strings(self.stop_strings, None)  # refuses bad or too many stop strings
        self.sampling  # refuses bad sampling parameters now, not at the first rollout

    @property
    def sampling(self) -> SamplingSpec:
        """Sampling at ``temperature`` (0 means greedy, as in NeMo-RL's configs)."""
        if self.temperature == 0:
            return GREEDY
        return SamplingSpec(greedy=False, temperature=self.temperature, top_p=self.top_p,
                            top_k=self.top_k, seed=self.seed)
