"""Refit, as services over ports: the driver's coordinator and each worker's side.

One walk, one name per step, from the driver down to the engine:

    init_collective      RefitCoordinator -> control "init_collective" -> WorkerRefit
                         -> RefitTarget.init_collective(GroupJoin): every engine rank joins
    prepare_refit_info   ... -> RefitInfo checked against the engine's parameters (no byte moved)
    update_weights       ... -> RefitTarget.update_weights(info): receive every bucket and load
                         it where the weights live, reset the prefix cache, version + 1
    flush_cache, weight_version
    reload_weights       ... -> control "check_checkpoint" on every worker, then "reload_weights"
                         -> DiskReloadTarget.reload_from_disk(path): a folder instead of a group

Driver: ``RefitCoordinator`` fans every step out to all workers' control channels (each a
``ports.control.WorkerControl``), bounded by a timeout, and aggregates failures (naming each
worker). Worker: ``WorkerRefit`` answers those controls for an engine implementing
``ports.engine.RefitTarget``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from rollout_fleet.core.clock import Clock, SystemClock
from rollout_fleet.core.control import WorkerControl
from rollout_fleet.core.control_relay import DEFAULT_RELAY_WIDTH, check_relay_width
from rollout_fleet.core.fanout import ControlCall, call_all, gather_workers, run_control_call
from rollout_fleet.core.disk_reload import DiskReload
from rollout_fleet.core.engine_ports import RefitTarget
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import (
    DEFAULT_REFIT_MODE,
    CollectiveSenderSpec,
    GroupJoin,
    RankLayout,
    RefitInfo,
    RefitMode,
    next_version,
    refit_mode,
)


class RefitCoordinator:
    """Driver side of a refit, across every worker. ``relay_width``: a step with one body for
    more workers than this goes to that many and is relayed on by them (core/control_relay.py;
    0: the driver calls every worker)."""

    def __init__(self, controls: Sequence[WorkerControl], *, ranks_per_worker: int = 1,
                 timeout_s: float = 600.0, relay_width: int = DEFAULT_RELAY_WIDTH) -> None:
        self._controls = list(controls)
        self._ranks_per_worker = ranks_per_worker
        self.timeout_s = timeout_s
        self.relay_width = check_relay_width(relay_width)
        self._group: tuple[str, ...] | None = None  # who the last init_collective asked to join
        self._newcomers: set[str] = set()  # joined the fleet, no refit loaded on them yet
        self._ipc_infos: dict[str, RefitInfo] = {}  # what each worker's IPC update last carried
        # Whether every worker is known to serve the same version (after an update through
        # here); until then the next update asks them and sets all to the newest + 1.
        self._versions_aligned = False

    @property
    def control_timeout_s(self) -> float:
        """A control waits a little longer than the transfer it drives, so a worker's own
        reason (who did not join, which bucket stalled) arrives before the driver gives up."""
        return self.timeout_s + max(1.0, 0.1 * self.timeout_s)

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(c.worker_id for c in self._controls)

    def forget_workers(self, worker_ids: Collection[str]) -> tuple[str, ...]:
        """Leave out lost workers from every later step: the next group is formed by the
        survivors alone (world size and rank layout recomputed). Returns those left out."""
        lost = tuple(c.worker_id for c in self._controls if c.worker_id in worker_ids)
        self._controls = [c for c in self._controls if c.worker_id not in worker_ids]
        self._newcomers -= set(lost)
        for worker in lost:
            self._ipc_infos.pop(worker, None)
        return lost

    def add_workers(self, controls: Sequence[WorkerControl]) -> tuple[str, ...]:
        """Workers that joined the running fleet: the next group is formed with them too, and
        the next update sets every worker to the fleet's next version. Returns their ids."""
        known = set(self.worker_ids)
        added = [c for c in controls if c.worker_id not in known]
        ids = [c.worker_id for c in added]
        if len(set(ids)) != len(ids):
            raise InvalidValue("workers", ids, "worker ids must be unique")
        self._controls.extend(added)
        self._newcomers.update(ids)
        if ids:
            self._versions_aligned = False
        return tuple(ids)

    @property
    def newcomers(self) -> tuple[str, ...]:
        """Workers added since the last successful update (they serve only after one)."""
        return tuple(w for w in self.worker_ids if w in self._newcomers)

    def layout(self, train_world_size: int) -> RankLayout:
        return RankLayout(train_world_size, len(self._controls), self._ranks_per_worker)

    def init_collective_plan(self, host: str, port: int, world_size: int, train_world_size: int,
                             spec: CollectiveSenderSpec) -> list[ControlCall]:
        """One call per worker; the world size is checked before any worker is asked. Worker i's
        engine ranks join at ``T + i*E + j``; the worker picks the backend (gloo or NCCL)."""
        layout = self.layout(train_world_size)
        layout.check_world_size(world_size)
        self._group = self.worker_ids
        calls = []
        for index, control in enumerate(self._controls):
            join = GroupJoin(host=host, port=port, world_size=world_size,
                             train_world_size=train_world_size,
                             first_rank=layout.worker_rank(index),
                             ranks_per_worker=self._ranks_per_worker, sender_spec=spec,
                             timeout_s=self.timeout_s, backend=None)
            calls.append(ControlCall(control, "init_collective", join.to_wire()))
        return calls

    def update_weights_plan(self, mode: RefitMode | None = None, *,
                            weight_version: int | None = None,
                            deadline_s: float | None = None) -> list[ControlCall]:
        """One call per worker. ``weight_version``: what every worker is set to (needed once
        workers joined: theirs started at 0). ``deadline_s``: how long each worker may take
        before it abandons the update (``worker_deadline_s``). Refused when the fleet changed
        since the group was formed: the trainer forms it again first."""
        self.check_group_current()
        body: dict[str, Any] = {} if mode is None else {"mode": mode}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if deadline_s is not None:
            body["deadline_s"] = worker_deadline_s(deadline_s)
        return [ControlCall(control, "update_weights", body) for control in self._controls]

    def ipc_stream_plan(self, info: RefitInfo, mode: RefitMode = DEFAULT_REFIT_MODE, *,
                        weight_version: int | None = None) -> list[ControlCall]:
        """One ``ipc_zmq_update`` per worker: each receives the stream of the trainer rank it
        shares a device with (core/ipc_stream.py); no group to form. The refit info goes to a
        worker only when it differs from the last one its update carried (the worker keeps
        it); after a failed update, with every worker's next one."""
        body: dict[str, Any] = {"mode": mode}
        if weight_version is not None:
            body["weight_version"] = weight_version
        calls: list[ControlCall] = []
        wire: dict[str, Any] | None = None  # made once for every worker that needs it
        for control in self._controls:
            held = self._ipc_infos.get(control.worker_id) == info
            if not held:
                wire = info.to_wire() if wire is None else wire
                self._ipc_infos[control.worker_id] = info
            calls.append(ControlCall(control, "ipc_zmq_update",
                                     body if held else {**body, "refit_info": wire}))
        return calls

    def check_group_current(self) -> None:
        if self._group is None or self._group == self.worker_ids:
            return
        joined = [w for w in self.worker_ids if w not in self._group]
        left = [w for w in self._group if w not in self.worker_ids]
        raise RefitError(f"the fleet changed since init_collective (joined: {joined}, left: "
                         f"{left}): call init_collective again, with the inference world size "
                         f"of {len(self._controls) * self._ranks_per_worker}")

    async def next_weight_version(self) -> int | None:
        """The version every worker takes at the next update: one above the newest any of them
        serves, so a worker that joined late (at 0) catches up. Asked of the workers while
        their versions may differ (before the first update through here, after a join);
        None once they are known to agree (each adds one)."""
        if self._versions_aligned:
            return None
        versions = await self.weight_versions()
        return max(versions.values()) + 1 if versions else None

    def updated(self, succeeded: bool = True) -> None:
        """The last update ended. Succeeded: every worker loaded it, at one version, and the
        newcomers are established. Failed: some may have loaded it, so versions may differ."""
        if succeeded:
            self._newcomers.clear()
        else:
            self._ipc_infos.clear()
        self._versions_aligned = succeeded

    def init_collective_calls(self, *args: Any) -> list[Awaitable[Mapping[str, Any]]]:
        return [run_control_call(c, self.control_timeout_s) for c in self.init_collective_plan(*args)]

    async def update_weights(self, mode: str | None = None) -> dict[str, int]:
        """Every worker receives and loads; WorkerFailures names each one that did not.
        ``mode`` (drain, keep, recompute; drain when None) says what happens to the rollouts
        in flight (core/refit.py); refused before any worker is asked."""
        plan = self.update_weights_plan(None if mode is None else refit_mode(mode),
                                        weight_version=await self.next_weight_version())
        try:
            answers = await self._call_all("update_weights", plan)
        except BaseException:
            self.updated(False)
            raise
        self.updated()
        return {worker: int(answer["weight_version"]) for worker, answer in answers.items()}

    async def reload_weights(self, path: str, *, mode: str | None = None,
                             deadline_s: float | None = None) -> dict[str, int]:
        """Every worker loads the checkpoint folder ``path`` (one each can read) in ``mode``
        (keep when None); versions as ``update_weights`` sets them. Each checks the folder
        first: one refused anywhere pauses no worker (WorkerFailures names each). Past
        ``deadline_s`` each worker abandons it (``RefitDeadline``)."""
        reload = DiskReload(path, mode=mode or "keep",
                            deadline_s=None if deadline_s is None else worker_deadline_s(deadline_s))
        deadline = None if deadline_s is None else RefitDeadline(deadline_s, self.worker_ids)
        await self._everywhere("check_checkpoint", {"path": reload.path})
        body = DiskReload(reload.path, reload.mode, await self.next_weight_version(),
                          reload.deadline_s).to_wire()
        calls = [ControlCall(c, "reload_weights", body) for c in self._controls]
        try:
            answers = await (self._call_all("reload_weights", calls) if deadline is None
                             else gather_workers("reload_weights", {  # each call its deadline
                                 c.worker_id: deadline.run(c) for c in calls}))
        except BaseException:
            self.updated(False)
            raise
        self.updated()
        return {worker: int(answer["weight_version"]) for worker, answer in answers.items()}

    async def prepare_refit_info(self, info: RefitInfo) -> None:
        await self._everywhere("prepare_refit_info", {"refit_info": info.to_wire()})

    async def invalidate_caches(self) -> None:
        await self._everywhere("flush_cache", {})

    async def weight_versions(self) -> dict[str, int]:
        answers = await self._everywhere("weight_version", {})
        return {worker: int(answer["weight_version"]) for worker, answer in answers.items()}

    async def _everywhere(self, step: str, body: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
        return await self._call_all(step, [ControlCall(c, step, body) for c in self._controls])

    async def _call_all(self, step: str, calls: Sequence[ControlCall]) -> dict[str, Mapping[str, Any]]:
        """The calls of one step, relayed where they can be; WorkerFailures names each failure."""
        return await call_all(step, calls, self.control_timeout_s, relay_width=self.relay_width)


def worker_deadline_s(deadline_s: float) -> float:
    """A worker abandons an update a little before the trainer's deadline, so that by the
    deadline its previous weights serve again and its own reason has reached the driver."""
    return deadline_s * 0.9


class RefitDeadline:
    """The trainer's deadline on one update, shared by every worker's call: a call that ends
    past the workers' bound fails naming the deadline and every worker not finished by then."""

    def __init__(self, deadline_s: float, worker_ids: Collection[str], *,
                 clock: Clock | None = None) -> None:
        if not isinstance(deadline_s, (int, float)) or not 0 < deadline_s < float("inf"):
            raise InvalidValue("refit_timeout_s", deadline_s, "must be a finite number > 0, or None")
        self.deadline_s = float(deadline_s)
        self._unfinished = set(worker_ids)
        self._clock = clock or SystemClock()
        self._started = self._clock.monotonic()

    async def run(self, call: ControlCall) -> Mapping[str, Any]:
        try:
            answer = await run_control_call(call, self.deadline_s)
        except Exception as exc:
            if self._clock.monotonic() - self._started < worker_deadline_s(self.deadline_s):
                raise  # failed for a reason of its own, before any deadline
            raise RefitError(
                f"the refit passed its deadline (refit_timeout_s={self.deadline_s:g} s): worker(s)"
                f" {sorted(self._unfinished)} did not finish; each abandons it and keeps serving"
                f" the weights it had ({call.worker_id}: {exc})") from None
        self._unfinished.discard(call.worker_id)
        return answer


Handler = Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]


class WorkerWeights:
    """The controls every worker whose engine is a ``ports.engine.RefitTarget`` serves, however
    its refits arrive: the cache flush and the weight version (what the driver's
    ``invalidate_caches`` and ``weight_versions`` ask)."""

    def __init__(self, target: RefitTarget) -> None:
        self._target = target

    def controls(self) -> dict[str, Handler]:
        return {"flush_cache": self.flush_cache, "weight_version": self.weight_version}

    async def flush_cache(self, body: Mapping[str, Any]) -> dict[str, Any]:
        await self._target.reset_cache()
        return {"weight_version": self._target.weight_version()}

    async def weight_version(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {"weight_version": self._target.weight_version()}


class WorkerRefit:
    """A worker's refit controls over its engine (a ``ports.engine.RefitTarget``): the engine
    receives inside itself, where its weights live; ``backend`` is this worker's transfer
    backend (gloo on CPUs, NCCL on GPUs) for joins that do not name one."""

    def __init__(self, target: RefitTarget, backend: str = "gloo", *,
                 clock: Clock | None = None) -> None:
        self._target = target
        self._clock = clock or SystemClock()
        self._backend = backend
        self._joined: GroupJoin | None = None
        self._info: RefitInfo | None = None
        self._lock = asyncio.Lock()

    def controls(self) -> dict[str, Handler]:
        return {"init_collective": self.init_collective, "prepare_refit_info": self.prepare_refit_info,
                "update_weights": self.update_weights, **WorkerWeights(self._target).controls()}

    async def init_collective(self, body: Mapping[str, Any]) -> dict[str, Any]:
        join = GroupJoin.from_wire({k: v for k, v in body.items() if v is not None},
                                   backend=self._backend)
        ranks = self._target.refit_ranks()
        if join.ranks_per_worker != ranks:
            raise InvalidValue("ranks_per_worker", join.ranks_per_worker,
                               f"this worker's engine has {ranks} rank(s) (tensor x pipeline"
                               " parallel); the driver's layout must say the same")
        async with self._lock:
            self._joined = None
            await self._target.init_collective(join)
            self._joined = join
        return {"ranks": [join.rank(j) for j in range(ranks)]}

    async def prepare_refit_info(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The info checked against the engine's parameters, which never change: once per
        info (a trainer sends the same one refit after refit), before any transfer."""
        info = RefitInfo.from_wire(_field(body, "refit_info"))
        if info != self._info:
            info.check_against(self._target.weight_metas())
        self._info = info
        return {"tensors": len(info.tensors), "bytes": info.total_bytes}

    async def update_weights(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if self._joined is None:
            raise RefitError("update_weights before init_collective on this worker")
        if self._info is None:
            raise RefitError("update_weights before prepare_refit_info on this worker")
        body = body if isinstance(body, Mapping) else {}
        mode = refit_mode(body.get("mode"))
        wanted = body.get("weight_version")
        next_version(self._target.weight_version(), wanted)  # refuse before any transfer
        async with self._lock:
            started = self._clock.monotonic()
            version = await _by_deadline(
                self._target.update_weights(self._info, mode=mode, version=wanted),
                body.get("deadline_s"))
        return {"weight_version": version, "seconds": round(self._clock.monotonic() - started, 6)}


async def _by_deadline(update: Awaitable[int], deadline_s: Any) -> int:
    """The engine's update, abandoned (cancelled) past ``deadline_s``: an engine swaps its
    weights only once everything arrived, so an abandoned update leaves the previous ones."""
    if deadline_s is None:
        return await update
    try:
        return await asyncio.wait_for(update, float(deadline_s))
    except (asyncio.TimeoutError, TimeoutError):
        raise RefitError(f"update_weights abandoned at this worker's deadline of "
                         f"{float(deadline_s):g} s; the previous weights serve") from None


def _field(body: Mapping[str, Any], key: str) -> Any:
    if not isinstance(body, Mapping) or key not in body:
        raise InvalidValue(key, None, "the control body must carry it")
    return body[key]
