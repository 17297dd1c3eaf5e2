"""The colocated refit inside vLLM's worker: the packed transfer engine, which also opens the
trainer's shared buffers (``core.colocated_refit``) and loads each bucket straight out of them.

vLLM keeps one weight-transfer engine per worker, chosen when the engine starts; this class is
that engine for the project's workers, so one worker takes packed refits over its group (the
parent class, unchanged) and colocated ones, told apart by the update request: a colocated
step is ``{"colocated": {"begin" | "bucket" | "end" | "abort": ...}}`` (a ``ColocatedStep``),
each one ``update_weights`` call between vLLM's ``start_weight_update`` and
``finish_weight_update``.

A bucket is loaded through the same ``load_weights`` and layerwise reload as a packed one, from
tensors that view the trainer's buffer (no copy on the way in). vLLM's reload keeps the parts
of a fused layer (q, k, v; gate, up) until the last part arrives, and a bucket may end between
them: those still held when the bucket is loaded are moved to a copy of their own before the
call answers, since the trainer then reuses the buffer; ``OpenedBuffer.close`` refuses (and
the refit fails, the weights recovered) if any view would be left behind. So the engine holds,
beyond its weights: the mapped buffers (the trainer's memory, ``num_buffers`` x the plan's
largest bucket), the copies of held parts (at most a fused layer's), and with
``rollback="last_good"`` a copy of the model (counted apart, as for packed refits).

A sender that keeps its buffers from one refit to the next says so (``keep_buffers`` in the
begin step): the engine then keeps them open too, opening a slot again only when its handle
changes, and closes them when the sender releases them (``release_kept_buffers``, through
the worker's ``colocated_release`` control), when a refit fails or keeps none, and at shutdown.

Such a sender holding the trainer's tensors in place sends every bucket in one step, the same
tensors at the same places every refit. Where the model loads in place (``InPlaceReload``: an
unquantized model on a GPU, a plain torch model), the first such load is recorded and
the next ones replay its copies without the loader (``load_replay``, which says when it does
not); under vLLM's layerwise reload the loader runs every time.

The buffer opener (``open_buffer``: shared memory or CUDA IPC, the collective adapter's) is
injected by the composition root, as the packed engine's receiver is.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from rollout_fleet.adapters.vllm.inside.colocated_session import ColocatedSession, KeptBuffers
from rollout_fleet.adapters.vllm.inside.load_replay import LoadReplay, recorder_for, replay_of
from rollout_fleet.adapters.vllm.inside.transfer_engine import InPlaceReload, PackedTransferEngine
from rollout_fleet.adapters.vllm.inside.transfer_support import synchronize
from rollout_fleet.adapters.vllm.messages import (
    COLOCATED_KEY, ColocatedBegin, ColocatedBucket, ColocatedStats, ColocatedUpdate, RefitInfoOnce,
)
from rollout_fleet.core.colocated_refit import BufferHandle, ColocatedStep
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.refit import Bucket, BucketEntry, RefitRollback

LAYERWISE_REFUSAL = ("vLLM's layerwise reload loads each layer into fresh tensors, then into the"
                     " parameters: not recorded")
log = logging.getLogger(__name__)


class ColocatedTransferEngine(PackedTransferEngine):
    # (handle, device) -> an opened buffer (``tensors(bucket)``, ``keep``, ``views_held``,
    # ``close``, ``nbytes``); set by the composition root.
    open_buffer: Callable[[BufferHandle, Any], Any] | None = None

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._session: ColocatedSession | None = None  # the colocated refit in progress
        self._kept = KeptBuffers()  # for a sender that keeps its buffers (``keep_buffers``)
        # The last in-place refit's load, recorded to be made again (``load_replay``), and the
        # key of the last one found not replayable, and why (not recorded again while it stays).
        self._replay: LoadReplay | None = None
        self._unreplayable: tuple[Any, str] | None = None
        self._colocated_infos = RefitInfoOnce()  # a begin carries the refit info on change

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if COLOCATED_KEY not in update_info:
            self._replay = None  # a packed refit may load the layers afresh: record again
            super().update_weights(update_info)
            return
        try:
            step = ColocatedUpdate.from_wire(update_info)
        except (RefitError, ValueError) as error:  # InvalidValue is a ValueError
            self._colocated_abort(f"an unreadable step: {error}", error)
            raise
        self.colocated_step(step)
        synchronize(self.device)  # every copy out of the buffer is done before the answer

    def colocated_step(self, step: ColocatedUpdate) -> None:
        if step.begin is not None:
            self._colocated_begin(step.begin)
        elif step.step is ColocatedStep.BUCKET:
            self._colocated_bucket(step.buckets[0])
        elif step.step is ColocatedStep.BUCKETS:
            self._colocated_buckets(step.buckets)
        elif step.step is ColocatedStep.END:
            self._colocated_end()
        else:  # ColocatedStep.ABORT, the last there is
            self._colocated_abort(step.reason)

    # -- steps ----------------------------------------------------------------------------------
    def _colocated_begin(self, begin: ColocatedBegin) -> None:
        if self.open_buffer is None:
            raise RefitError(f"{type(self).__name__}.open_buffer is not set: register the engine"
                             " through the composition root")
        if self._session is not None:
            self._session.close_opened()
        if not begin.keep_buffers:
            self.release_kept_buffers()
        self.rollback = begin.rollback
        self._session = ColocatedSession(
            self._colocated_infos.incoming(begin.info), frozenset(begin.skip),
            [] if self.rollback is RefitRollback.LAST_GOOD else None, time.perf_counter(),
            keep=begin.keep_buffers)

    def _colocated_bucket(self, sent: ColocatedBucket) -> None:
        session = self._current()
        handle = sent.handle
        try:
            bucket = Bucket(tuple(BucketEntry(session.metas[name], offset)
                                  for name, offset in sent.tensors), sent.nbytes)
            opened = self._opened(session, handle)
            watched: list[weakref.ref] = []
            self._load_bucket(session, opened, handle.slot, bucket, watched)
            for ref in watched:  # what the reload still holds: its own copy from now on
                tensor = ref()
                if tensor is not None:
                    session.held.track(tensor, opened.keep(tensor))
                tensor = None
            if opened.views_held():
                raise RefitError(f"{opened.views_held()} view(s) into buffer {handle.slot} are still"
                                 " held after its bucket was loaded")
        except BaseException as error:
            self._colocated_abort(f"bucket failed: {error}", error)
            raise
        session.buckets += 1

    def _colocated_buckets(self, buckets: tuple[ColocatedBucket, ...]) -> None:
        """Several buckets in one step. Where the sender keeps its buffers and no rollback copy
        is kept (the trainer's tensors held in place), the load is recorded the first time and
        replayed after, as long as nothing it relied on changed (``load_replay``)."""
        session = self._current()
        key = self._replay_key(session, buckets)
        replay, self._replay = self._replay, None
        if key is not None and replay is not None and replay.matches(key, self._kept.slots(),
                                                                     self.model):
            self._replay_load(session, replay, buckets)
            return
        known = self._unreplayable
        if key is not None and known is not None and known[0] == key:
            session.refusal = known[1]  # found before: not recorded again
        elif key is not None and not isinstance(self.reload, InPlaceReload):
            session.refusal = LAYERWISE_REFUSAL
        session.recording = key is not None and not session.refusal
        for bucket in buckets:
            self._colocated_bucket(bucket)
        if session.recording:
            self._keep_recording(session, key)

    @staticmethod
    def _replay_key(session: ColocatedSession, buckets: tuple[ColocatedBucket, ...]) -> Any:
        if not session.keep or session.kept is not None:
            return None
        return (session.info, session.skip, buckets)

    def _replay_load(self, session: ColocatedSession, replay: LoadReplay,
                     buckets: tuple[ColocatedBucket, ...]) -> None:
        try:
            replay.replay()
        except BaseException as error:
            self._colocated_abort(f"replaying the recorded load failed: {error}", error)
            raise
        self._replay = replay
        session.loaded += sum(len(bucket.tensors) for bucket in buckets)
        session.buckets += len(buckets)
        session.slots.update(slot for slot, _ in replay.buffers)
        session.mapped_peak = max(session.mapped_peak,
                                  sum(opened.nbytes for opened in self._kept.buffers()))
        session.replayed = True

    def _keep_recording(self, session: ColocatedSession, key: Any) -> None:
        result = session.refusal or replay_of(
            key, tuple((slot, self._kept.buffer(slot)) for slot in sorted(session.slots)),
            self.model, session.recorded, session.recorded_bytes)
        session.recorded = []
        if isinstance(result, str):
            session.refusal, self._unreplayable = result, (key, result)
            log.info("the colocated load will not be replayed: %s", result)
        else:
            self._replay = result

    def _load_bucket(self, session: ColocatedSession, opened: Any, slot: int, bucket: Bucket,
                     watched: list) -> None:
        tensors = self._bucket_tensors(session, opened, bucket, watched)
        if not session.recording or session.refusal:
            self.model.load_weights(tensors)
            return
        recorder = recorder_for(self.model, [(slot, opened)])
        with recorder:
            self.model.load_weights(tensors)
        session.refusal = recorder.refusal or ""
        session.recorded.extend(recorder.writes)
        session.recorded_bytes += sum(e.meta.nbytes for e in bucket.entries
                                      if e.meta.name not in session.skip)

    @staticmethod
    def _bucket_tensors(session: ColocatedSession, opened: Any, bucket: Bucket,
                        watched: list) -> Iterator[tuple[str, Any]]:
        for name, tensor in opened.tensors(bucket):
            session.loaded += 1
            if session.kept is not None:  # the rollback copy is what the loader gets
                tensor = tensor.clone()
                session.kept.append((name, tensor))
            else:
                watched.append(weakref.ref(tensor))
            if name not in session.skip:
                yield name, tensor
            tensor = None  # hold no view while the loader works on the next

    def _colocated_end(self) -> None:
        session = self._current()
        self._session = None
        session.close_opened()
        self._kept.close_unused(session.slots)  # the sender no longer uses the others
        if session.loaded != len(session.info.tensors):
            self._colocated_infos.forget()
            self.recover(RefitError("incomplete"), loaded=session.loaded)
            raise RefitError(f"colocated refit ended after {session.loaded} of"
                             f" {len(session.info.tensors)} tensors")
        if session.kept is not None:
            self._last_good = [item for item in session.kept if item[0] not in session.skip]
        self.stats = ColocatedStats(
            tensors=session.loaded, nbytes=session.info.total_bytes,
            seconds=time.perf_counter() - session.started, buckets=session.buckets,
            mapped_peak_bytes=session.mapped_peak, held_copy_bytes=session.held.total,
            held_copy_peak_bytes=session.held.peak, opened_buffers=session.opened_count,
            replayed=session.replayed, replay_refusal=session.refusal)

    def _colocated_abort(self, reason: str, error: BaseException | None = None) -> None:
        session, self._session = self._session, None
        self._replay = None
        self._colocated_infos.forget()  # a failed refit: the next begin carries its info
        if session is None:
            return
        try:
            session.close_opened()
            self.release_kept_buffers()  # a failed refit keeps nothing of the trainer's
        except RefitError:
            pass  # a view still held: the mapping stays (nothing dangles); the reload recovers
        self.recover(error or RefitError(reason), loaded=session.loaded)

    # -- buffers --------------------------------------------------------------------------------
    def _opened(self, session: ColocatedSession, handle: BufferHandle) -> Any:
        """Each trainer buffer is opened once per refit and closed at its end; where the
        sender keeps its buffers, once for as long as the slot's handle stays the same."""
        session.slots.add(handle.slot)
        if session.keep:
            opened = self._kept.opened(handle, lambda new: self._open(session, new))
            mapped = self._kept.buffers()
        else:
            opened = session.opened.get(handle.slot)
            if opened is None or opened.nbytes != handle.nbytes:
                if opened is not None:
                    opened.close()
                opened = session.opened[handle.slot] = self._open(session, handle)
            mapped = list(session.opened.values())
        session.mapped_peak = max(session.mapped_peak, sum(o.nbytes for o in mapped))
        return opened

    def _open(self, session: ColocatedSession, handle: BufferHandle) -> Any:
        if self.open_buffer is None:
            raise RefitError(f"{type(self).__name__}.open_buffer is not set")
        session.opened_count += 1
        return self.open_buffer(handle, self.device)

    def release_kept_buffers(self) -> int:
        """Close every buffer kept open across refits (the sender is done with them, a refit
        failed, or one came that keeps none); how many were open."""
        self._replay = None  # it reads these buffers
        return self._kept.close_all()

    def _current(self) -> ColocatedSession:
        session = self._session
        if session is None:
            raise RefitError("colocated bucket before the refit began on this rank")
        return session

    def shutdown(self) -> None:
        self._colocated_abort("the weight-transfer engine shut down")
        self.release_kept_buffers()
        super().shutdown()


def compose_colocated_engine(base: type, join_receiver: Callable, open_buffer: Callable,
                             module: str = __name__,
                             name: str = "RolloutFleetTransferEngine") -> type:
    """``ColocatedTransferEngine`` on top of vLLM's base class, receiver and opener set; an
    abstract method of ``base`` left unimplemented is named here (as ``compose_transfer_engine``)."""
    cls = types.new_class(name, (ColocatedTransferEngine, base), exec_body=lambda ns: ns.update(
        join_receiver=staticmethod(join_receiver), open_buffer=staticmethod(open_buffer),
        __module__=module))
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(f"{name}: vLLM's {base.__qualname__} declares abstract methods the"
                        f" project's refit engine lacks: {', '.join(missing)}")
    return cls
