"""The fleet config's ``[colocation]`` section: which workers share their devices with which
trainer ranks, and how they sleep between generation phases (core/sleep.py).

    [colocation]
    enabled = true
    sleep_level = 1                  # 1: free the KV cache; 2: the weights too (refit after)
    sleep_mode = "wait"              # what a sleep does to rollouts in flight
    [colocation.trainer_ranks]       # default: worker i's engine rank j with trainer rank i*E + j
    worker-0 = [0]
    worker-1 = [1]

What it implies: the colocated workers sleep at the driver's ``finish_generation`` and wake at
its ``prepare_for_generation``; on GPUs their vLLM engines start with sleep mode on, and each
engine should take only its share of the GPU (``engine.gpu_memory_utilization``), since the
trainer rank on that GPU needs the rest while the engine is awake.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from rollout_fleet.core.device import Device
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.sleep_state import DEFAULT_SLEEP_LEVEL, DEFAULT_SLEEP_MODE, sleep_level, sleep_mode
from rollout_fleet.core.validate import a_bool, check_known_keys, is_int

# A colocated engine above this share of its GPU leaves its trainer rank little room.
GPU_SHARE_REMINDER = 0.5



def _level(_inst: Any, _attr: Any, value: Any) -> None:
    try:
        sleep_level(value)
    except InvalidValue as error:
        raise InvalidValue("colocation.sleep_level", value, error.rule) from None


def _mode(inst: Any, _attr: Any, value: Any) -> None:
    try:
        sleep_mode(value)
    except InvalidValue as error:
        raise InvalidValue("colocation.sleep_mode", value, error.rule) from None
    if value == "keep" and inst.sleep_level >= 2:
        raise InvalidValue("colocation.sleep_mode", value, "a level-2 sleep drops the weights the"
                           " kept rollouts would continue on: use wait or abort")


def _ranks(value: Any) -> dict[str, tuple[int, ...]] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidValue("colocation.trainer_ranks", value, "must map worker names to trainer"
                           " ranks (e.g. {worker-0 = [0]})")
    ranks = {}
    for worker, given in value.items():
        listed = [given] if is_int(given) else given
        if not isinstance(listed, list | tuple) or not listed \
                or not all(is_int(r) and r >= 0 for r in listed):
            raise InvalidValue(f"colocation.trainer_ranks.{worker}", given,
                               "must be a trainer rank (an int >= 0) or a list of them, one per"
                               " engine rank of the worker")
        ranks[str(worker)] = tuple(int(r) for r in listed)
    return ranks


@attrs.frozen
class ColocationConfig:
    enabled: bool = attrs.field(default=False, validator=a_bool("colocation.enabled"))
    trainer_ranks: dict[str, tuple[int, ...]] | None = attrs.field(default=None, converter=_ranks)
    sleep_level: int = attrs.field(default=DEFAULT_SLEEP_LEVEL, validator=_level)
    sleep_mode: str = attrs.field(default=DEFAULT_SLEEP_MODE, validator=_mode)

    @classmethod
    def from_mapping(cls, data: Any) -> "ColocationConfig":
        if isinstance(data, ColocationConfig):
            return data
        if not isinstance(data, Mapping):
            raise InvalidValue("colocation", data, "must be a table")
        check_known_keys(data, {f.name for f in attrs.fields(cls)}, "colocation.")
        return cls(**data)

    def placement(self, worker_names: list[str], ranks_per_worker: int) -> dict[str, tuple[int, ...]]:
        """Worker name -> the trainer rank on the device of each of its engine ranks; empty
        when colocation is off. Refuses unknown workers, a wrong count, a rank used twice."""
        if not self.enabled:
            return {}
        if self.trainer_ranks is None:
            return {name: tuple(i * ranks_per_worker + j for j in range(ranks_per_worker))
                    for i, name in enumerate(worker_names)}
        for worker, ranks in self.trainer_ranks.items():
            if worker not in worker_names:
                raise InvalidValue(f"colocation.trainer_ranks.{worker}", list(ranks),
                                   f"no such worker; the fleet has {', '.join(worker_names)}")
            if len(ranks) != ranks_per_worker:
                raise InvalidValue(f"colocation.trainer_ranks.{worker}", list(ranks),
                                   f"one trainer rank per engine rank: {ranks_per_worker}")
        used = [r for ranks in self.trainer_ranks.values() for r in ranks]
        twice = sorted({r for r in used if used.count(r) > 1})
        if twice:
            raise InvalidValue("colocation.trainer_ranks", self.trainer_ranks,
                               f"trainer rank {twice[0]} shares a device with two engine ranks")
        return dict(self.trainer_ranks)

    def reminders(self, device: Device, engine: Mapping[str, Any]) -> list[str]:
        """What a colocated fleet's user should know (logged when the fleet starts)."""
        if not self.enabled:
            return []
        if Device.parse(device, "device") is not Device.GPU:
            return ["colocation.enabled on a CPU fleet: the workers sleep and wake as the"
                    " trainer asks where their engine can (the memory engine; vLLM has no sleep"
                    " mode on the CPU and refuses)"]
        share = engine.get("gpu_memory_utilization", 0.9)
        if isinstance(share, int | float) and share > GPU_SHARE_REMINDER:
            return [f"colocation.enabled: engine.gpu_memory_utilization={share} leaves the"
                    " trainer rank on each GPU little room while the engine is awake; give the"
                    " engine its share only (NeMo-RL's colocated configs use about 0.6 or less)"]
        return []
