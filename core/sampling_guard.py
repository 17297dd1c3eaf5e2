"""The on-policy sampling guard of a trainer's agent traffic (pure): a chat request that feeds
training must sample as the trainer's policy does, so its logprobs are the policy's.

A request passes when its ``top_k`` is unset or -1 (no truncation the trainer does not
apply), its ``top_p`` is given explicitly (an unset one would be resolved by the serving
engine from the model's generation config, out of the trainer's sight), and its
``(temperature, top_p)`` is exactly the train profile or the validation profile (NeMo-RL's
``generation.temperature/top_p`` and ``val_temperature/val_top_p``). A refusal names the
field, its value and both profiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from rollout_fleet.core.errors import InvalidValue


class OffPolicySampling(InvalidValue):
    """A request's sampling is not the trainer's: names the field, the value and the profiles."""


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise InvalidValue(field, value, "must be a finite number")
    return float(value)


@attrs.frozen
class SamplingProfile:
    temperature: float = attrs.field(converter=float)
    top_p: float = attrs.field(converter=float)

    def __attrs_post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidValue("temperature", self.temperature, "must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidValue("top_p", self.top_p, "must be in (0, 1]")

    def describe(self) -> str:
        return f"temperature={self.temperature:g}, top_p={self.top_p:g}"


@attrs.frozen
class SamplingProfiles:
    """The trainer's two sampling profiles (the validation one defaults to the train one)."""

    train: SamplingProfile
    validation: SamplingProfile

    @classmethod
    def from_wire(cls, value: object, field: str = "sampling") -> SamplingProfiles:
        """NeMo-RL's generation-config names: ``temperature``, ``top_p`` and, optionally,
        ``val_temperature``, ``val_top_p``."""
        if not isinstance(value, Mapping):
            raise InvalidValue(field, value, "must be an object: {temperature, top_p, "
                                             "val_temperature, val_top_p}")
        names = ("temperature", "top_p", "val_temperature", "val_top_p")
        for name in value:
            if name not in names:
                raise InvalidValue(f"{field}.{name}", value[name], f"is not one of {names}")
        for name in names[:2]:
            if name not in value:
                raise InvalidValue(f"{field}.{name}", None, "is required")
        numbers = {name: _number(f"{field}.{name}", value[name]) for name in value}
        train = SamplingProfile(numbers["temperature"], numbers["top_p"])
        validation = SamplingProfile(numbers.get("val_temperature", train.temperature),
                                     numbers.get("val_top_p", train.top_p))
        return cls(train, validation)

    def to_wire(self) -> dict[str, float]:
        return {"temperature": self.train.temperature, "top_p": self.train.top_p,
                "val_temperature": self.validation.temperature,
                "val_top_p": self.validation.top_p}

    def check(self, body: Mapping[str, Any]) -> None:
        """Refuse (``OffPolicySampling``) a request body whose sampling is neither profile."""
        top_k = body.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or top_k != -1):
            raise OffPolicySampling("top_k", top_k, "must be unset or -1: the trainer's policy "
                                                    "samples from the whole vocabulary")
        top_p = body.get("top_p")
        if top_p is None:
            raise OffPolicySampling("top_p", None, "must be given explicitly (an unset top_p "
                                                   "is the serving engine's default, not the "
                                                   f"trainer's): {self._profiles()}")
        temperature = body.get("temperature")
        asked = (_number("temperature", temperature) if temperature is not None else None,
                 _number("top_p", top_p))
        allowed = [(p.temperature, p.top_p) for p in (self.train, self.validation)]
        if asked in allowed:
            return
        field, value = ("top_p", top_p) if asked[0] in [t for t, _ in allowed] else \
            ("temperature", temperature)
        raise OffPolicySampling(field, value, f"(temperature={temperature}, top_p={top_p}) is "
                                              f"neither of the trainer's profiles: "
                                              f"{self._profiles()}")

    def _profiles(self) -> str:
        return (f"train ({self.train.describe()}), validation "
                f"({self.validation.describe()})")
