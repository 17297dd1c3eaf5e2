"""RayPlacement: one placement-group bundle per worker, a supervising actor in each bundle."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.adapters.ray.sealed import seal
from rollout_fleet.adapters.shared import is_loopback
from rollout_fleet.adapters.ray.supervisor import ProcessSupervisor
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.ports.placement import (Placement, WorkerHandle, WorkerLaunch,
                                           refuse_live_places, refuse_taken_names)


_ALIVE_TIMEOUT_S = 30.0
_EXIT_STATUS_TIMEOUT_S = 5.0  # asked only of a worker already found gone: words, not a verdict
_REPLACE_PAUSE_S = 1.0  # before another supervisor in a bundle whose node just died


class PlacementError(RolloutFleetError):
    """Ray could not reserve or start the workers."""


class RayPlacement(Placement):
    """Places workers with Ray: each launch reserves a placement group of its own.

    ``address=None`` starts a private local Ray instance (stopped again by ``stop``); an address
    joins an existing cluster, which is left running (this process disconnects at ``stop``).
    ``bundle`` is each worker's reservation, e.g. ``{"CPU": 1}`` on CPU fleets or
    ``{"GPU": 2, "CPU": 2}`` for a 2-rank GPU worker, plus any custom resource that pins
    workers to the nodes offering it. ``bind_host`` is this (the driver's) node's address: a
    local Ray runs there, and a cluster is joined from there. ``bind_per_node``: each worker
    binds its own node's address in the cluster (found on that node) instead of ``bind_host``.
    ``reserve_timeout_s``: how long a launch waits for room for its bundles (default
    ``ready_timeout_s``); ``ready_timeout_s``: how long each worker's supervisor may take to be
    placed and started, in a reserved bundle or in a lost worker's.

    ``groups``: placement groups reserved already (NeMo-RL's cluster for inference): workers
    go there, none is reserved, and none is removed at ``stop``. Each worker takes
    ``bundles_per_worker`` consecutive bundles of one group (one per engine rank, as NeMo-RL
    lays them out): its supervisor sits in the first, and where the bundles hold GPUs, a
    holder in each keeps its GPU for the worker, which sees them all (CUDA_VISIBLE_DEVICES).
    """

    def __init__(self, *, address: str | None = None, bundle: Mapping[str, float] | None = None,
                 strategy: str = "PACK", bind_host: str = "127.0.0.1", num_cpus: int | None = None,
                 ready_timeout_s: float = 120.0, reserve_timeout_s: float | None = None,
                 bind_per_node: bool = False, groups: Sequence[Any] = (),
                 bundles_per_worker: int = 1) -> None:
        self._address = address
        self._given = _places_in(groups, bundles_per_worker)  # (group, bundle indices) each
        self._given_taken = 0
        self._holders: dict[str, list[Any]] = {}  # worker -> the actors holding its GPUs
        self._bundle = dict(bundle or {"CPU": 1})
        self._strategy = strategy
        self._bind_host = bind_host
        self._bind_per_node = bind_per_node
        self._num_cpus = num_cpus
        self._ready_timeout_s = ready_timeout_s
        self._reserve_timeout_s = ready_timeout_s if reserve_timeout_s is None \
            else reserve_timeout_s
        self._started_ray = False
        self._joined_ray = False
        self._groups: list[Any] = []  # one placement group per launch
        self._actors: dict[str, Any] = {}
        self._handles: dict[str, WorkerHandle] = {}
        self._places: dict[str, tuple[Any, tuple[int, ...]]] = {}  # worker -> (group, bundles)
        self._replaced: set[str] = set()  # lost workers a later launch took the place of

    def launch(self, launches: Sequence[WorkerLaunch]) -> Sequence[WorkerHandle]:
        import ray
        refuse_taken_names(launches, self._actors)
        self._init_ray(len(launches))
        if any(launch.in_place_of for launch in launches):
            refuse_live_places(launches, self.alive(), self._replaced)
        fresh = [launch for launch in launches if not launch.in_place_of]
        fresh_places = iter(self._reserve(len(fresh)) if fresh else [])
        handles = []
        for launch in launches:
            place = self._take_place_of(launch.in_place_of) if launch.in_place_of \
                else next(fresh_places)
            actor, key = self._placed_supervisor(launch, place)
            # Sealed for this actor's own key: no Ray object holds the secret itself.
            sealed = None if launch.secret is None else seal(launch.secret, key)
            bind_host = None if self._bind_per_node else self._bind_host
            env = {**launch.env, **self._held_gpus(launch, place)}
            started = ray.get(actor.start.remote(launch.argv, env, launch.log_path,
                                                 launch.port_env, bind_host, sealed,
                                                 launch.host_env, launch.folder_env))
            # index continues after the workers of earlier launches
            handle = WorkerHandle(len(self._handles), launch.name, started["pid"],
                                  started["node_ip"], started["ports"], launch.log_path,
                                  started["node_id"])
            self._handles[launch.name] = handle
            handles.append(handle)
        return handles

    def _take_place_of(self, lost: str) -> tuple[Any, tuple[int, ...]]:
        """The bundle of a lost worker: its supervising actor is ended, so what it held there
        is free again (if the node itself was lost, Ray places the bundle anew elsewhere)."""
        import ray

        try:
            ray.kill(self._actors[lost])
        except Exception:  # noqa: BLE001 - gone with its node already
            pass
        self._replaced.add(lost)
        return self._places[lost]

    def _placed_supervisor(self, launch: WorkerLaunch, place: tuple[Any, tuple[int, ...]]
                           ) -> tuple[Any, Any]:
        """A supervising actor in ``place`` and its public key, once Ray has placed it.

        The bundle of a lost node may still be booked on that node until Ray declares the node
        dead (missed heartbeats): an actor sent there dies unstarted, and is made again until
        Ray has placed the bundle anew. PlacementError if it was not placed in time (its slot
        taken away, or room for it nowhere)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        supervisor = ray.remote(ProcessSupervisor)
        deadline = time.monotonic() + self._ready_timeout_s
        cpus, gpus = self._supervisor_resources(place)
        while True:
            actor = supervisor.options(
                name=None, num_cpus=cpus, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=place[0], placement_group_bundle_index=place[1][0]),
            ).remote()
            self._actors[launch.name] = actor
            self._places[launch.name] = place
            try:
                left_s = max(0.1, deadline - time.monotonic())
                return actor, ray.get(actor.public_key.remote(), timeout=left_s)
            except ray.exceptions.ActorDiedError:
                if time.monotonic() < deadline:
                    time.sleep(_REPLACE_PAUSE_S)
                    continue
                error = "its actor died before it started, each time"
            except ray.exceptions.GetTimeoutError:
                error = "no room for it, or its process slow to start"
            ray.kill(self._actors.pop(launch.name))
            self._places.pop(launch.name, None)
            self._replaced.discard(launch.in_place_of)  # a later launch may try that place again
            raise PlacementError(
                f"Ray did not place {launch.name}"
                + (f" in the place of {launch.in_place_of}" if launch.in_place_of else "")
                + f" within {self._ready_timeout_s:.0f} s ({error}); available: "
                f"{ray.available_resources()}") from None

    def _supervisor_resources(self, place: tuple[Any, tuple[int, ...]]) -> tuple[float, float]:
        """In a group of its own, the worker's bundle; in a given group, the CPUs it needs
        out of its first bundle's (the bundles' GPUs are kept by holders: ``_held_gpus``)."""
        if not self._given:
            return self._bundle.get("CPU", 0), self._bundle.get("GPU", 0)
        spec = place[0].bundle_specs[place[1][0]]
        cpus = min(self._bundle.get("CPU", 0), spec.get("CPU", 0))
        return cpus, 0.0

    def _held_gpus(self, launch: WorkerLaunch, place: tuple[Any, tuple[int, ...]]) -> dict:
        """In a given group whose bundles hold GPUs: a holder per bundle keeps its GPU, and the
        worker is told to see them all (its engine ranks span them)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not self._given or not any(place[0].bundle_specs[i].get("GPU", 0) for i in place[1]):
            return {}
        holders = self._holders.get(launch.in_place_of) or [
            ray.remote(_BundleHolder).options(
                num_cpus=0, num_gpus=place[0].bundle_specs[index].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=place[0], placement_group_bundle_index=index)).remote()
            for index in place[1]]
        self._holders[launch.name] = holders
        ids = ray.get([holder.gpu_ids.remote() for holder in holders],
                      timeout=self._ready_timeout_s)
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpu for held in ids for gpu in held)}

    def _reserve(self, count: int) -> list[tuple[Any, tuple[int, ...]]]:
        """``count`` places: the next free ones of the given groups, else a placement group of
        ``count`` bundles of its own, ready (one per launch: groups are fixed-size)."""
        if self._given:
            return self._take_given(count)
        group = self._reserve_group(count)
        return [(group, (index,)) for index in range(count)]

    def _take_given(self, count: int) -> list[tuple[Any, tuple[int, ...]]]:
        left = len(self._given) - self._given_taken
        if count > left:
            raise PlacementError(
                f"the given placement groups have room for {len(self._given)} workers"
                f" ({left} free) and {count} more were asked for")
        places = self._given[self._given_taken:self._given_taken + count]
        self._given_taken += count
        return places

    def _reserve_group(self, count: int) -> Any:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([dict(self._bundle) for _ in range(count)], strategy=self._strategy)
        try:
            ray.get(group.ready(), timeout=self._reserve_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)  # a pending group would take resources as they free
            raise PlacementError(
                f"Ray could not reserve {count} bundles of {self._bundle} within "
                f"{self._reserve_timeout_s:.0f} s ({len(self._actors)} workers already placed keep "
                f"running); available: {ray.available_resources()}, cluster: "
                f"{ray.cluster_resources()}") from None
        self._groups.append(group)
        return group

    def alive(self) -> Mapping[str, bool]:
        import ray

        # Asked of every supervisor at once: one unreachable node costs one wait, not one each.
        asked = {name: actor.alive.remote() for name, actor in list(self._actors.items())
                 if name not in self._replaced}
        status = dict.fromkeys(self._replaced, False)  # their supervisors were ended
        for name, answer in asked.items():
            try:
                status[name] = bool(ray.get(answer, timeout=_ALIVE_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - a dead actor means a dead worker
                status[name] = False
        return status

    def exit_status(self, name: str) -> int | None:
        import ray

        if name in self._replaced:
            return None  # its supervisor, which saw it end, was ended
        try:
            return ray.get(self._actors[name].exit_status.remote(), timeout=_EXIT_STATUS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - its supervisor (or node) is gone: nobody saw it end
            return None

    def kill(self, name: str) -> None:
        import ray

        ray.get(self._actors[name].kill.remote(), timeout=30)

    def signal(self, name: str, signum: int) -> None:
        import ray

        ray.get(self._actors[name].signal.remote(signum), timeout=30)

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        # A replaced worker is long dead and its supervisor ended: its pid may be another's now.
        running = {name: actor for name, actor in self._actors.items() if name not in self._replaced}
        if not ray.is_initialized():
            self._kill_by_pid(list(running))
            return
        unstopped = []
        for name, actor in running.items():
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - the actor may be gone; the pid fallback follows
                unstopped.append(name)
            ray.kill(actor)
        self._kill_by_pid(unstopped)
        self._actors.clear()
        self._handles.clear()
        self._places.clear()
        self._replaced.clear()
        for holder in (h for held in self._holders.values() for h in held):
            ray.kill(holder)
        self._holders.clear()
        for group in self._groups:  # never the given ones: their owner removes them
            remove_placement_group(group)
        self._groups.clear()
        if self._started_ray or self._joined_ray:
            ray.shutdown()  # a joined cluster keeps running; this process leaves it
            self._started_ray = self._joined_ray = False

    def _init_ray(self, num_workers: int) -> None:
        import ray

        if ray.is_initialized():
            return
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                   "configure_logging": False}
        if self._address:
            if not is_loopback(self._bind_host):
                # Ray would guess this node's address from a route to the internet, which a
                # cluster network need not have; the driver joins from its cluster address.
                options["_node_ip_address"] = self._bind_host
            ray.init(address=self._address, **options)
            self._joined_ray = True
        else:
            cpus = self._num_cpus or max(os.cpu_count() or 1,
                                         int(num_workers * self._bundle.get("CPU", 1)))
            ray.init(num_cpus=cpus, _node_ip_address=self._bind_host, **options)
            self._started_ray = True

    def _kill_by_pid(self, names: Sequence[str]) -> None:
        """A worker whose actor died before stopping it: stop it by its process group (same node)."""
        for name in names:
            handle = self._handles.get(name)
            if handle is None or handle.node_ip not in ("127.0.0.1", self._bind_host):
                continue
            try:
                os.killpg(handle.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class _BundleHolder:
    """Keeps one bundle's GPU reserved for a worker whose engine ranks span several bundles."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(gpu) for gpu in ray.get_gpu_ids()]


def _places_in(groups: Sequence[Any], bundles_per_worker: int) -> list[tuple[Any, tuple[int, ...]]]:
    """Each worker's bundles in the given groups: consecutive runs of ``bundles_per_worker``."""
    places = []
    for number, group in enumerate(groups):
        count = group.bundle_count
        if count % bundles_per_worker:
            raise PlacementError(f"placement group {number} has {count} bundles, not a multiple"
                                 f" of the {bundles_per_worker} bundles of one worker")
        places += [(group, tuple(range(start, start + bundles_per_worker)))
                   for start in range(0, count, bundles_per_worker)]
    return places

