"""Placement port: reserve resources for workers, start each worker's process, stop them.

Adapters: Ray (adapters/ray: a placement group per launch, one bundle and supervising actor
per worker, on one node or a cluster) and local processes (adapters/local: processes of this
machine, started new or forked from a worker template). ``rollout_fleet.ports.contracts.placement``
checks both (the local one in each way).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence

import attrs

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import Vocabulary


class PlacementKind(Vocabulary):
    """The placements a fleet config may name (its ``placement``)."""

    RAY = "ray"  # a Ray placement group, on one node or a cluster (adapters/ray)
    LOCAL = "local"  # processes of this machine, forked from a worker template or new (adapters/local)


@attrs.frozen
class WorkerLaunch:
    """How to start one worker: its command, environment and log, and the ports it needs.

    ``port_env`` names environment variables that must each hold a free port on the node the
    worker lands on; the placement picks them there (so it works across machines).

    ``secret`` (the fleet's control secret) reaches the worker as one line on its standard
    input, and never in its arguments, environment or log: those other users of the node can
    read. The placement carries it to the worker's node so that nothing else can read it on
    the way (RayPlacement seals it for the supervising actor's own key).

    ``host_env`` names a variable that must hold the address the worker binds its servers to:
    the placement's bind address, or the node's own cluster address when workers bind per node.

    ``folder_env`` names a variable that must hold a folder of the worker's own on its node,
    private to its user: the placement makes it before the worker starts and removes it, with
    whatever is left in it, once the worker is gone (stopped or killed).

    ``in_place_of`` names a lost worker of this placement whose reservation this one takes (a
    replacement needs no new resources); refused while that worker still runs. The lost one
    stays reported, as not alive.
    """

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = attrs.field(factory=dict)
    log_path: str = ""
    port_env: tuple[str, ...] = ()
    secret: str | None = attrs.field(default=None, repr=False)
    host_env: str = ""
    in_place_of: str = ""
    folder_env: str = ""


@attrs.frozen
class WorkerHandle:
    index: int
    name: str
    pid: int
    node_ip: str  # the address the worker's servers bind (and are reached at)
    ports: Mapping[str, int]  # port_env name -> the port chosen on the worker's node
    log_path: str
    node_id: str = ""  # the placement's name for the node it runs on ("" when it has none)


class Placement(ABC):
    @abstractmethod
    def launch(self, launches: Sequence[WorkerLaunch]) -> Sequence[WorkerHandle]:
        """Reserve one slot per worker and start each; return handles in the same order.

        May be called again to add workers (a replacement for a lost one, or more of them):
        those placed before keep running, and the new handles' ``index`` continues after the
        workers placed so far. Names are unique across calls: a launch naming a worker this
        placement already has is refused (before anything starts) with an error naming it.
        """

    @abstractmethod
    def alive(self) -> Mapping[str, bool]:
        """Worker name -> whether its process still runs."""

    def exit_status(self, name: str) -> int | None:
        """How one worker's process ended, once it has: its exit code, or minus the signal
        that ended it (-9: SIGKILL, the kernel's out-of-memory killer's); None while it runs
        or where this placement cannot tell."""
        return None

    def helper_process_groups(self) -> list[int]:
        """The process groups of what this placement runs on this machine beside the workers
        (a local placement's worker template); ``stop`` ends them too."""
        return []

    @abstractmethod
    def kill(self, name: str) -> None:
        """Stop one worker's process now (fault drills, a failed health check)."""

    @abstractmethod
    def signal(self, name: str, signum: int) -> None:
        """Send ``signum`` to one worker's process group (SIGSTOP/SIGCONT: fault drills)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every worker and release the reservation; safe to repeat."""


def refuse_taken_names(launches: Sequence[WorkerLaunch], taken: Collection[str]) -> None:
    """Raise InvalidValue naming the first name in ``launches`` that is in ``taken`` (the
    placement's workers) or named twice in ``launches``."""
    named = set()
    for launch in launches:
        if launch.name in taken:
            raise InvalidValue("WorkerLaunch.name", launch.name, "a worker of this placement has "
                               f"it already (workers: {sorted(taken)})")
        if launch.name in named:
            raise InvalidValue("WorkerLaunch.name", launch.name, "named twice in one launch")
        named.add(launch.name)


def refuse_live_places(launches: Sequence[WorkerLaunch], alive: Mapping[str, bool],
                       replaced: Collection[str] = ()) -> None:
    """Raise InvalidValue naming the first ``in_place_of`` that is no lost worker of the
    placement (``alive``: its workers), was ``replaced`` already, or that two launches name."""
    taken = set(replaced)
    for launch in launches:
        place = launch.in_place_of
        if not place:
            continue
        if place not in alive:
            why = "is no worker of this placement"
        elif alive[place]:
            why = "still runs"
        elif place in taken:
            why = "has a replacement already"
        else:
            taken.add(place)
            continue
        raise InvalidValue("WorkerLaunch.in_place_of", place,
                           f"must name a lost worker of this placement, once: it {why}")
