"""Engine kinds: how a fleet makes one kind of engine, found by name in an entry-point group.

A backend package registers its kind in its own ``pyproject.toml``::

    [project.entry-points."rollout_fleet.engines"]
    counting = "counting_backend:CountingKind"

and a fleet config selects it with ``engine = { kind = "counting", ... }``. The config (when
it is loaded), the fleet (when it launches each worker) and the worker (when it builds its
engine) all find the kind the same way; the project's own ``memory`` and ``vllm`` kinds are
registered like any other. Only ``build`` is required; ``parse`` turns the config's engine
table into the kind's typed settings, which every other hook is handed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs
from rollout_fleet.core.device import Device
from rollout_fleet.core.engine import EnginePort

ENGINE_KINDS_GROUP = "rollout_fleet.engines"
Settings = TypeVar("Settings")

# An extra control a worker serves at POST /engine/control/<name> (the fleet secret required).
Control = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _device(value: Any) -> Device:
    return Device.parse(value, "device")


@attrs.frozen
class FleetFacts:
    """What an engine kind may read of the fleet that serves it."""

    device: Device = attrs.field(default=Device.CPU, converter=_device)
    max_model_len: int = 512
    num_workers: int = 1
    kv_routing: bool = False  # the frontend routes by KV-cache events
    model: str = "tiny"  # the fleet's model folder, or "tiny"
    one_host: bool = True  # every worker runs on this machine (no Ray cluster joined)
    colocated: bool = False  # workers share devices with trainer ranks and sleep in between


@attrs.frozen
class BuiltEngine:
    """An engine built in a worker process: the engine, the model folder Dynamo registers it
    with (config and tokenizer), and any extra controls the worker serves."""

    engine: EnginePort
    model_path: str
    controls: Mapping[str, Control] = attrs.field(factory=dict)


class EngineKind(ABC, Generic[Settings]):
    """One kind of engine, with its typed settings (``Settings``: the class ``parse`` returns).

    The engine table (the config's ``engine`` without ``kind``) is parsed once in each process
    that reads it: by the config loader, with the fleet's facts (fleet-level defaults filled
    in, the options checked against the fleet), and by each worker, from the table the fleet
    wrote for it (``fleet`` None). Every other hook is handed the parsed value."""

    def parse(self, options: Mapping[str, Any], fleet: FleetFacts | None) -> Settings:
        """This kind's settings from the engine table; raise ``InvalidValue`` naming the bad
        option, before any process starts. Default: the table itself, as a dict."""
        return dict(options)  # type: ignore[return-value]  # a kind that parses nothing: its Settings is this dict

    def options(self, settings: Settings) -> dict[str, Any]:
        """The settings as the engine table a worker is sent (JSON values; ``parse`` reads it
        back). Default: a dict, or an attrs class's fields."""
        kind = type(settings)
        if attrs.has(kind):
            return {field.name: getattr(settings, field.name) for field in attrs.fields(kind)}
        if isinstance(settings, Mapping):
            return dict(settings)
        raise TypeError(f"{kind.__name__} settings are neither a mapping nor an attrs class:"
                        " the engine kind must override options()")

    def refit_ranks(self, settings: Settings) -> int:
        """How many ranks one engine holds in the refit group (tensor x pipeline parallel)."""
        return 1

    def ranks_source(self, settings: Settings) -> str:
        """Which options decide ``refit_ranks``, for the error when the fleet disagrees."""
        return "its kind's default"

    def model_folder(self, settings: Settings, run_dir: Path) -> str | None:
        """For ``model = "tiny"``: a model folder this kind writes into the run folder itself
        (once, before any worker starts); None: the project's tiny model is built."""
        return None

    def for_worker(self, settings: Settings, fleet: FleetFacts, *, slot: int,
                   free_port: Callable[[], int]) -> Settings:
        """The settings worker ``slot`` (0 .. num_workers - 1, its share of the host) gets:
        per-worker defaults filled in. Default: the settings as they are."""
        return settings

    @abstractmethod
    def build(self, settings: Settings, *, run_dir: Path, model_path: str | None) -> BuiltEngine:
        """Make the engine, inside the worker process (``model_path``: the fleet's model
        folder, or None when the kind makes its own)."""
