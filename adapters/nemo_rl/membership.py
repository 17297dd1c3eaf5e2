"""Which workers the NeMo-RL driver reaches: those it was built with, less the ones the fleet
reports lost (left out for good), plus those that joined the running fleet.

The fleet is asked who is lost where the trainer forms its refit group
(``get_inference_world_size``, ``init_collective``) and after a step failed on some worker,
never before a step that succeeds: a step that failed only on lost workers runs again on the
survivors (``FleetGeneration``), so each step still leaves the lost ones out. Who joined is
asked only where the trainer sizes its group: a worker that became ready between
``init_collective`` and the update would otherwise void a refit under way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

import attrs
from rollout_fleet.adapters.nemo_rl.colocated import ColocatedPhases
from rollout_fleet.adapters.nemo_rl.worker_metrics import MetricTimelines
from rollout_fleet.core.errors import WorkerFailures
from rollout_fleet.core.refit_service import RefitCoordinator
from rollout_fleet.ports.control import WorkerControl
from rollout_fleet.ports.metrics import WorkerMetrics

log = logging.getLogger("rollout_fleet.adapters.nemo_rl.generation")


@attrs.frozen
class JoinedWorker:
    """A worker that joined the running fleet, as the driver reaches it."""

    control: WorkerControl
    metrics: WorkerMetrics | None = None


class FleetMembership:
    """The driver's workers (``controls``), kept the same in every part that reaches them: the
    refit coordinator, the colocated phases and the metric timelines."""

    def __init__(self, controls: Sequence[WorkerControl], *, refit: RefitCoordinator,
                 colocated: ColocatedPhases, metrics: MetricTimelines,
                 lost_workers: Callable[[], Collection[str]] | None = None,
                 joined_workers: Callable[[Collection[str]], Sequence[JoinedWorker]] | None = None,
                 ) -> None:
        self.controls = tuple(controls)
        self._refit, self._colocated, self._metrics = refit, colocated, metrics
        self._lost_workers = lost_workers
        self._joined_workers = joined_workers
        self._left: set[str] = set()  # forgotten for good: a lost worker never comes back

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(c.worker_id for c in self.controls)

    def forget(self, worker_ids: Collection[str]) -> tuple[str, ...]:
        """Leave these workers out of every later step; returns those that were here."""
        lost = self._refit.forget_workers(set(worker_ids))
        if lost:
            log.warning("leaving out lost worker(s) %s; serving on %s", list(lost),
                        list(self._refit.worker_ids))
            self.controls = tuple(c for c in self.controls if c.worker_id not in lost)
            self._metrics.keep_only(self.worker_ids)
            self._colocated.keep_only(self.worker_ids)
        return lost

    def add(self, workers: Sequence[JoinedWorker]) -> tuple[str, ...]:
        """Workers that joined (none that was lost); returns those new here."""
        workers = [w for w in workers if w.control.worker_id not in self._left]
        added = self._refit.add_workers([w.control for w in workers])
        if added:
            log.warning("worker(s) %s joined; the next init_collective forms the group with "
                        "%d worker(s)", list(added), len(self._refit.worker_ids))
            joined = [w for w in workers if w.control.worker_id in added]
            self.controls = (*self.controls, *(w.control for w in joined))
            self._metrics.add([w.metrics for w in joined if w.metrics is not None])
        return added

    def forget_lost(self) -> frozenset[str]:
        """Ask the fleet who is lost and leave them out; returns every lost worker it named."""
        if self._lost_workers is None:
            return frozenset()
        lost = frozenset(self._lost_workers())
        self._left.update(self.forget(lost))
        return lost

    def take_in_joined(self) -> None:
        if self._joined_workers is not None:
            self.add(self._joined_workers(frozenset(self.worker_ids) | self._left))

    def left_out_after(self, failed: WorkerFailures) -> bool:
        """A step failed: the lost workers are left out. True when every worker it failed on
        was lost (those a relay through them never reached aside), so that the step may run
        again on the survivors."""
        lost = self.forget_lost()
        return bool(failed.failed_themselves) and failed.failed_themselves <= lost
