"""The trainer's end of a colocated refit: ``ColocatedSender(control, ...).send(state_dict)``.

The trainer runs on the same device as the worker's engine (the same host on the CPU, the same
GPU on a GPU) and reaches the worker's control routes through ``control`` (a
``ports.control.WorkerControl``: the fleet's HTTP control with its secret, as every refit).
It packs bucket k into buffer ``k % num_buffers`` while the engine loads bucket k - 1, so with
two buffers packing and loading overlap; the calls themselves go one after the other, in
order. Its pool is allocated at the first send (sized by that refit's plan) and reused by
every later one with the same plan; ``close`` frees it.

In place (``make_resident``): the trainer's own tensors move into the sender's buffers once,
one buffer per bucket, each tensor rebound there (``.data``); an optimizer that steps in place
keeps them there. A refit of them then copies nothing on the trainer's side: the engine loads
each bucket straight out of the trainer's parameters, one copy per refit in all. A tensor found
elsewhere at a send (replaced by the trainer) is copied back into its place first, and counted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from rollout_fleet.adapters.collective.colocated import BufferPool, indexed_device
from rollout_fleet.adapters.collective.packing import check_tensor, pack_bucket, unpack_bucket
from rollout_fleet.adapters.collective.transfer import refit_info_of
from rollout_fleet.core.colocated_refit import ColocatedManifest, bucket_entries_wire
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import Bucket, plan_buckets, refit_mode

logger = logging.getLogger(__name__)

_sessions = itertools.count(1)


@attrs.frozen
class ColocatedResult:
    """One colocated refit, as the trainer saw it."""

    weight_version: int
    seconds: float  # start to finish answered
    pack_s: float  # of which packing buffers (overlapping the engine's loads)
    wait_s: float  # of which waiting for the engine's answers
    nbytes: int  # the model's bytes moved
    buckets: int
    pool_bytes: int  # what the trainer's buffers hold: the whole transfer's footprint here
    engine: Mapping[str, Any] = attrs.field(factory=dict)  # the engine's own stats
    # In place: the tensors found away from their place and copied back before the refit.
    moved_tensors: int = 0


class ColocatedSender:
    def __init__(self, control: Any, *, buffer_bytes: int = 1 << 30, num_buffers: int = 2,
                 device: Any = "cpu", timeout_s: float = 600.0, mode: str | None = None) -> None:
        self.control = control
        self.device = indexed_device(torch.device(device))
        self.buffer_bytes, self.num_buffers = buffer_bytes, num_buffers
        self.timeout_s, self.mode = timeout_s, refit_mode(mode)
        self._pool: BufferPool | None = None
        self._places: InPlaceLayout | None = None  # the in-place layout, once made
        self._worker_holds_buffers = False  # a refit went out: the worker may keep them open
        # ``send``'s own loop, kept across refits: a fresh loop per refit would start new
        # threads and a new control connection each time (a few ms of a small model's refit)
        self._loop: asyncio.AbstractEventLoop | None = None

    def make_resident(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Move ``tensors`` (the trainer's own: ``dict(module.named_parameters())``, not a
        ``state_dict()`` copy) into this sender's buffers and rebind each there; later sends of
        the same names, shapes and dtypes refit in place. Once only per sender."""
        if self._places is not None:
            raise RefitError("this sender already holds the trainer's tensors in place")
        info = refit_info_of(tensors)
        for name, tensor in tensors.items():
            if indexed_device(tensor.device) != self.device:
                raise InvalidValue(f"tensors[{name!r}].device", str(tensor.device),
                                   f"must be the sender's device ({self.device})")
        plan = plan_buckets(info.tensors, self.buffer_bytes)
        manifest = ColocatedManifest(info, self.buffer_bytes, max(1, len(plan)), self._transport)
        self._close_pool()
        pool = self._pool = BufferPool(manifest.slot_bytes, manifest.num_buffers, self.device)
        with torch.no_grad():
            for slot, bucket in enumerate(plan):
                for name, view in unpack_bucket(pool.buffer(slot), bucket):
                    view.copy_(tensors[name])
                    tensors[name].data = view
        self._places = InPlaceLayout(manifest, pool)

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> ColocatedResult:
        """One refit from a plain (synchronous) trainer loop; see ``send_async``."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.send_async(state_dict, version))

    async def send_async(self, state_dict: Mapping[str, torch.Tensor],
                         version: int | None = None) -> ColocatedResult:
        """Refit the worker with ``state_dict`` (in its order); returns the new weight version
        (``version`` when given) and the timings. A refusal or failure raises after telling
        the worker to give the refit up, so it keeps serving."""
        places = self._places
        if places is not None:
            manifest, info = places.manifest, places.manifest.info
            places.check(state_dict)
        else:
            info = refit_info_of(state_dict)
            manifest = ColocatedManifest(info, self.buffer_bytes, self.num_buffers, self._transport)
        pool = places.pool if places is not None else self._pool_for(manifest)
        session = f"colocated-{os.getpid()}-{next(_sessions)}"
        started = time.perf_counter()
        # The pool outlives this refit (until close or a resize): the worker may keep it open.
        start = {"session": session, "manifest": places.manifest_wire if places is not None
                 else manifest.to_wire(), "mode": self.mode, "keep_buffers": True}
        self._worker_holds_buffers = True
        if version is not None:
            start["weight_version"] = version
        await self._call("colocated_start", start)
        try:
            if places is not None:
                pack_s, moved = places.back_in_place(state_dict)
                wait_s = await self._in_place_buckets(session, places)
            else:
                moved = 0
                pack_s, wait_s = await self._buckets(session, manifest.plan, pool, state_dict)
            answer = await self._call("colocated_finish", {"session": session})
        except BaseException as error:
            await self._abort(session, error)
            raise
        return ColocatedResult(int(answer["weight_version"]), time.perf_counter() - started,
                               pack_s, wait_s, info.total_bytes, len(manifest.plan), pool.nbytes,
                               answer.get("stats", {}), moved)

    @property
    def _transport(self) -> str:
        return "cuda" if self.device.type == "cuda" else "shm"

    async def _in_place_buckets(self, session: str, places: "InPlaceLayout") -> float:
        """Bucket k is buffer k, already holding the trainer's tensors, and no buffer is reused
        within the refit: every bucket goes in one call, answered once all are loaded."""
        started = time.perf_counter()
        await self._call("colocated_buckets", {"session": session, "buckets": places.buckets_wire})
        return time.perf_counter() - started

    async def _buckets(self, session: str, plan: tuple[Bucket, ...], pool: BufferPool,
                       state_dict: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        pending: asyncio.Task | None = None
        pending_slot = -1
        pack_s = wait_s = 0.0
        try:
            for index, bucket in enumerate(plan):
                slot = index % pool.num_buffers
                if pending is not None and pending_slot == slot:  # one buffer: wait for it
                    wait_s += await _timed(pending)
                    pending = None
                tensors = [state_dict[e.meta.name] for e in bucket.entries]
                for entry, tensor in zip(bucket.entries, tensors):
                    check_tensor(entry.meta, entry.meta.name, tensor)
                pack_s += await asyncio.to_thread(_pack, pool, slot, bucket, tensors)
                if pending is not None:
                    wait_s += await _timed(pending)
                body = {"session": session, "index": index, "tensors": bucket_entries_wire(bucket),
                        "handle": pool.handle(slot).to_wire()}
                pending, pending_slot = asyncio.ensure_future(self._call("colocated_bucket", body)), slot
            if pending is not None:
                wait_s += await _timed(pending)
                pending = None
        finally:
            if pending is not None:
                pending.cancel()
        return pack_s, wait_s

    def _pool_for(self, manifest: ColocatedManifest) -> BufferPool:
        pool = self._pool
        if pool is None or pool.slot_bytes != manifest.slot_bytes:
            self._close_pool()
            pool = self._pool = BufferPool(manifest.slot_bytes, manifest.num_buffers, self.device)
        return pool

    async def _call(self, name: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
        try:
            return await asyncio.wait_for(self.control.call(name, body, timeout_s=self.timeout_s),
                                          self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise RefitError(f"{name} on worker {self.control.worker_id} timed out after"
                             f" {self.timeout_s:g} s") from None

    async def _abort(self, session: str, error: BaseException) -> None:
        try:
            await self._call("colocated_abort", {"session": session, "reason": str(error)[:500]})
        except Exception:  # noqa: BLE001 - the worker gives the session up on its own in time
            pass

    async def release_async(self) -> None:
        """Tell the worker to close this sender's buffers it keeps open between refits (it
        does so by itself at the next refit that keeps none, a failed one, or its shutdown).
        Best effort: a worker that cannot be reached keeps nothing of a trainer gone."""
        if not self._worker_holds_buffers:
            return
        self._worker_holds_buffers = False
        try:
            await self._call("colocated_release", {})
        except Exception as error:  # noqa: BLE001 - the sender closes all the same
            logger.warning("worker %s did not release the colocated buffers: %s",
                           self.control.worker_id, error)

    async def aclose(self) -> None:
        """``close`` for a sender driven from the caller's own event loop (``send_async``)."""
        await self.release_async()
        self.close()

    def close(self) -> None:
        """Release the worker's hold on the buffers (from this sender's own loop, where
        ``send`` made one; a ``send_async`` user calls ``aclose``), then free them."""
        if self._worker_holds_buffers and self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self.release_async())
        self._close_pool()
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            try:  # what asyncio.run does at its end: the control's clients close with the loop
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    def _close_pool(self) -> None:
        pool, self._pool = self._pool, None
        places, self._places = self._places, None
        if pool is not None and places is not None:
            pool.release_to_views()  # the trainer's tensors live there: theirs to free
        elif pool is not None:
            pool.close()

    def __enter__(self) -> "ColocatedSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InPlaceLayout:
    """The trainer's tensors held in place: each one's view in its bucket's buffer, made once,
    and the start's manifest and the buckets' call, the same every refit, spelt once."""

    def __init__(self, manifest: ColocatedManifest, pool: BufferPool) -> None:
        self.manifest, self.pool, self.device = manifest, pool, pool.device
        self.places: dict[str, tuple[Any, torch.Tensor]] = {}  # name -> (meta, view)
        for slot, bucket in enumerate(manifest.plan):
            for entry, (name, view) in zip(bucket.entries, unpack_bucket(pool.buffer(slot), bucket)):
                self.places[name] = (entry.meta, view)
        self.manifest_wire = manifest.to_wire()
        self.buckets_wire = [{"index": index, "tensors": bucket_entries_wire(bucket),
                              "handle": pool.handle(index).to_wire()}
                             for index, bucket in enumerate(manifest.plan)]

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The tensors held in place, by name, shape and dtype: refused before any call."""
        if state_dict.keys() != self.places.keys():
            raise InvalidValue("state_dict", f"{len(state_dict)} tensors", "the sender holds"
                               f" {len(self.places)} other tensors in place: send those (same"
                               " names, shapes, dtypes)")
        for name, tensor in state_dict.items():
            view = self.places[name][1]
            if tensor.shape != view.shape or tensor.dtype != view.dtype:
                raise InvalidValue(f"state_dict[{name!r}]", f"{list(tensor.shape)} {tensor.dtype}",
                                   f"the sender holds it in place as {list(view.shape)}"
                                   f" {view.dtype}: send the same names, shapes, dtypes")

    def back_in_place(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[float, int]:
        """(seconds, tensors moved): each tensor not at its place (the trainer replaced it)
        is checked and copied there; the rest are left as they are."""
        started, moved = time.perf_counter(), 0
        with torch.no_grad():
            for name, tensor in state_dict.items():
                meta, view = self.places[name]
                if meta.nbytes and tensor.data_ptr() != view.data_ptr():
                    check_tensor(meta, name, tensor)
                    view.copy_(tensor)
                    moved += 1
        if self.device.type == "cuda":  # the trainer's last step, and these copies, are done
            torch.cuda.synchronize(self.device)  # before the engine reads through its handles
        return time.perf_counter() - started, moved


def _pack(pool: BufferPool, slot: int, bucket: Bucket, tensors: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    pack_bucket(pool.buffer(slot), bucket, tensors)
    if pool.device.type == "cuda":  # the engine reads the buffer once the call arrives
        torch.cuda.current_stream(pool.device).synchronize()
    return time.perf_counter() - started


async def _timed(task: asyncio.Future) -> float:
    started = time.perf_counter()
    await task
    return time.perf_counter() - started
