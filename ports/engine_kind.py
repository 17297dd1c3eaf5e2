"""Engine kinds: how a fleet makes one kind of engine, found by name in an entry-point group.

A backend package registers its kind in its own ``pyproject.toml``::

    [project.entry-points."rollout_fleet.engines"]
    counting = "counting_backend:CountingKind"

and a fleet config selects it with ``engine = { kind = "counting", ... }``. The config (when
it is loaded), the fleet (when it launches each worker) and the worker (when it builds its
engine) all find the kind the same way; the project's own ``memory`` and ``vllm`` kinds are
registered like any other. Only ``build`` is required.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
from rollout_fleet.core.engine import EnginePort

ENGINE_KINDS_GROUP = "rollout_fleet.engines"

# An extra control a worker serves at POST /engine/control/<name> (the fleet secret required).
Control = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@attrs.frozen
class FleetFacts:
    """What an engine kind may read of the fleet that serves it."""

    device: str = "cpu"  # "cpu" or "gpu"
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


class EngineKind(ABC):
    """One kind of engine. ``options`` is the config's engine table without ``kind``."""

    def check(self, options: Mapping[str, Any], fleet: FleetFacts) -> None:
        """Refuse bad options when the config is loaded, before any process starts: raise
        ``InvalidValue`` naming the option. Default: every option is accepted."""

    def refit_ranks(self, options: Mapping[str, Any]) -> int:
        """How many ranks one engine holds in the refit group (tensor x pipeline parallel)."""
        return 1

    def ranks_source(self, options: Mapping[str, Any]) -> str:
        """Which options decide ``refit_ranks``, for the error when the fleet disagrees."""
        return "its kind's default"

    def model_folder(self, options: Mapping[str, Any], run_dir: Path) -> str | None:
        """For ``model = "tiny"``: a model folder this kind writes into the run folder itself
        (once, before any worker starts); None: the project's tiny model is built."""
        return None

    def worker_options(self, options: Mapping[str, Any], fleet: FleetFacts, *, slot: int,
                       free_port: Callable[[], int]) -> dict[str, Any]:
        """The engine table as worker ``slot`` (0 .. num_workers - 1, its share of the host)
        gets it: fleet-level defaults filled in. Default: the options as they are."""
        return dict(options)

    @abstractmethod
    def build(self, options: Mapping[str, Any], *, run_dir: Path,
              model_path: str | None) -> BuiltEngine:
        """Make the engine, inside the worker process (``model_path``: the fleet's model
        folder, or None when the kind makes its own)."""
