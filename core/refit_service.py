"""Refit, as services over ports: the driver's coordinator and each worker's side.

Driver: ``RefitCoordinator`` fans every step out to all workers' control channels, bounded by a
timeout, and aggregates failures (naming each worker). Worker: ``WorkerRefit`` answers those
controls: it builds its collective receiver, checks the refit info against the engine's
parameters before any byte moves, stages a whole transfer, and only then loads it, so a transfer
that dies half way leaves the engine on its old weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
from rollout_fleet.core.errors import InvalidValue, RefitError, WorkerFailures
from rollout_fleet.core.refit import (
    CollectiveSenderSpec,
    RankLayout,
    RefitInfo,
    TensorMeta,
)


class WorkerControlLike(Protocol):
    worker_id: str

    async def call(self, name: str, body: Mapping[str, Any], *, timeout_s: float | None = None
                   ) -> Mapping[str, Any]: ...


@attrs.frozen
class ControlCall:
    """One control request to one worker, not yet sent (a driver may run it where it likes)."""

    control: Any  # WorkerControlLike
    name: str
    body: Mapping[str, Any]

    @property
    def worker_id(self) -> str:
        return self.control.worker_id


async def run_control_call(call: ControlCall, timeout_s: float) -> Mapping[str, Any]:
    """Send one control call, bounded by ``timeout_s``."""
    try:
        return await asyncio.wait_for(call.control.call(call.name, call.body, timeout_s=timeout_s),
                                      timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise RefitError(f"{call.name} on worker {call.worker_id} timed out after "
                         f"{timeout_s:.0f} s") from None


class RefitCoordinator:
    """Driver side of a refit, across every worker."""

    def __init__(self, controls: Sequence[WorkerControlLike], *, ranks_per_worker: int = 1,
                 timeout_s: float = 600.0) -> None:
        self._controls = list(controls)
        self._ranks_per_worker = ranks_per_worker
        self.timeout_s = timeout_s

    def layout(self, train_world_size: int) -> RankLayout:
        return RankLayout(train_world_size, len(self._controls), self._ranks_per_worker)

    def init_collective_plan(self, host: str, port: int, world_size: int, train_world_size: int,
                             spec: CollectiveSenderSpec) -> list[ControlCall]:
        """One call per worker; the world size is checked before any worker is asked."""
        layout = self.layout(train_world_size)
        layout.check_world_size(world_size)
        return [ControlCall(control, "init_collective", {
            "host": host, "port": port, "world_size": world_size,
            "rank": layout.worker_rank(index), "train_world_size": train_world_size,
            "sender_spec": spec.to_wire(), "timeout_s": self.timeout_s,
        }) for index, control in enumerate(self._controls)]

    def update_weights_plan(self) -> list[ControlCall]:
        return [ControlCall(control, "update_weights", {}) for control in self._controls]

    def init_collective_calls(self, *args: Any) -> list[Awaitable[Mapping[str, Any]]]:
        return [run_control_call(c, self.timeout_s) for c in self.init_collective_plan(*args)]

    def update_weights_calls(self) -> list[Awaitable[Mapping[str, Any]]]:
        """One awaitable per worker (a trainer sends while these wait)."""
        return [run_control_call(c, self.timeout_s) for c in self.update_weights_plan()]

    async def update_weights(self) -> dict[str, int]:
        """Every worker receives and loads; WorkerFailures names each one that did not."""
        answers = await gather_workers("update_weights", {
            c.worker_id: run_control_call(c, self.timeout_s) for c in self.update_weights_plan()})
        return {worker: int(answer["weight_version"]) for worker, answer in answers.items()}

    async def prepare_refit_info(self, info: RefitInfo) -> None:
        await self._everywhere("prepare_refit_info", {"refit_info": info.to_wire()})

    async def invalidate_caches(self) -> None:
        await self._everywhere("flush_cache", {})

    async def weight_versions(self) -> dict[str, int]:
        answers = await self._everywhere("weight_version", {})
        return {worker: int(answer["weight_version"]) for worker, answer in answers.items()}

    async def _everywhere(self, step: str, body: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
        return await gather_workers(step, {
            c.worker_id: run_control_call(ControlCall(c, step, body), self.timeout_s)
            for c in self._controls})


async def gather_workers(step: str, calls: Mapping[str, Awaitable[Any]]) -> dict[str, Any]:
    """Await every worker's call; raise WorkerFailures naming each one that failed."""
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    failures = {n: r for n, r in zip(names, results) if isinstance(r, BaseException)}
    if failures:
        raise WorkerFailures(step, failures)
    return dict(zip(names, results))


class ReceiverLike(Protocol):
    def receive(self, info: RefitInfo) -> Iterable[tuple[str, Any]]: ...
    def close(self) -> None: ...


class LoaderLike(Protocol):
    def weight_metas(self) -> Mapping[str, TensorMeta]: ...
    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int: ...
    def weight_version(self) -> int: ...
    async def reset_cache(self) -> None: ...


# (host, port, rank, world_size, train_world_size, sender spec, timeout_s) -> receiver
ReceiverFactory = Callable[[str, int, int, int, int, CollectiveSenderSpec, float], ReceiverLike]


class WorkerRefit:
    """A worker's refit controls: init_collective, prepare_refit_info, update_weights, flush_cache,
    weight_version. Blocking collective work runs in a thread so the worker keeps serving."""

    def __init__(self, loader: LoaderLike, make_receiver: ReceiverFactory) -> None:
        self._loader = loader
        self._make_receiver = make_receiver
        self._receiver: ReceiverLike | None = None
        self._info: RefitInfo | None = None
        self._lock = asyncio.Lock()

    def controls(self) -> dict[str, Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]]:
        return {"init_collective": self.init_collective, "prepare_refit_info": self.prepare_refit_info,
                "update_weights": self.update_weights, "flush_cache": self.flush_cache,
                "weight_version": self.weight_version}

    async def init_collective(self, body: Mapping[str, Any]) -> dict[str, Any]:
        host, port, world_size, rank, train_world_size = (_field(body, k) for k in (
            "host", "port", "world_size", "rank", "train_world_size"))
        spec = CollectiveSenderSpec.from_wire(_field(body, "sender_spec"))
        timeout_s = float(body.get("timeout_s", 600.0))
        async with self._lock:
            self._close_receiver()
            self._receiver = await asyncio.to_thread(
                self._make_receiver, host, port, rank, world_size, train_world_size, spec, timeout_s)
        return {"rank": rank}

    async def prepare_refit_info(self, body: Mapping[str, Any]) -> dict[str, Any]:
        info = RefitInfo.from_wire(_field(body, "refit_info"))
        info.check_against(self._loader.weight_metas())  # refuse before any transfer
        self._info = info
        return {"tensors": len(info.tensors), "bytes": info.total_bytes}

    async def update_weights(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if self._receiver is None:
            raise RefitError("update_weights before init_collective on this worker")
        if self._info is None:
            raise RefitError("update_weights before prepare_refit_info on this worker")
        async with self._lock:
            receiver, info = self._receiver, self._info
            started = time.perf_counter()
            staged = await asyncio.to_thread(lambda: list(receiver.receive(info)))
            received = time.perf_counter()
            version = await self._loader.load_weights(staged)
            loaded = time.perf_counter()
        return {"weight_version": version, "receive_s": round(received - started, 6),
                "load_s": round(loaded - received, 6)}

    async def flush_cache(self, body: Mapping[str, Any]) -> dict[str, Any]:
        await self._loader.reset_cache()
        return {"weight_version": self._loader.weight_version()}

    async def weight_version(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {"weight_version": self._loader.weight_version()}

    def close(self) -> None:
        self._close_receiver()

    def _close_receiver(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


def _field(body: Mapping[str, Any], key: str) -> Any:
    if not isinstance(body, Mapping) or key not in body:
        raise InvalidValue(key, None, "the control body must carry it")
    return body[key]
