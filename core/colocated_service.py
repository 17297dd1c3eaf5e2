"""A worker's colocated-refit controls over its engine (``ports.colocated.ColocatedTarget``).

Each control is one step of ``core.colocated_refit.ColocatedSession``; the session is checked
here, before the engine is asked to do anything, so every engine refuses the same steps the
same way. A session with no call for ``idle_timeout_s`` is given up (its trainer is gone): the
engine recovers and serves again, as after any failed refit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rollout_fleet.core.clock import Clock, SystemClock
from rollout_fleet.core.colocated_refit import BufferHandle, ColocatedManifest, ColocatedSession
from rollout_fleet.core.engine_ports import ColocatedTarget
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import next_version, refit_mode
from rollout_fleet.core.wire_memo import LastParsed

CONTROLS = ("colocated_start", "colocated_bucket", "colocated_buckets", "colocated_finish",
            "colocated_abort", "colocated_release")
DEFAULT_IDLE_TIMEOUT_S = 600.0


class WorkerColocatedRefit:
    def __init__(self, target: ColocatedTarget, *, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 clock: Clock | None = None) -> None:
        if isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, (int, float)) \
                or not idle_timeout_s > 0:
            raise InvalidValue("idle_timeout_s", idle_timeout_s, "must be a number > 0")
        self._target = target
        self._clock = clock or SystemClock()
        self._idle_timeout_s = float(idle_timeout_s)
        self._session: ColocatedSession | None = None
        self._lock = asyncio.Lock()
        self._expiry: asyncio.TimerHandle | None = None
        self._started = 0.0
        # A trainer sends the same manifest every refit: parsed, and checked against the
        # engine's parameters, once while both stay the same.
        self._manifests = LastParsed(ColocatedManifest.from_wire, ColocatedManifest.to_wire)
        self._checked: tuple[ColocatedManifest, Mapping[str, Any]] | None = None

    def controls(self) -> dict[str, Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]]:
        return {"colocated_start": self.start, "colocated_bucket": self.bucket,
                "colocated_buckets": self.buckets, "colocated_finish": self.finish,
                "colocated_abort": self.abort, "colocated_release": self.release}

    @property
    def session(self) -> ColocatedSession | None:
        return self._session

    async def start(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Check the manifest against the engine (names, shapes, dtypes; transport; version)
        before anything is loaded, then let the engine begin."""
        body = _mapping(body)
        manifest = self._manifests(body.get("manifest"))
        mode = refit_mode(body.get("mode"))
        keep_buffers = body.get("keep_buffers", False)
        if not isinstance(keep_buffers, bool):
            raise InvalidValue("keep_buffers", keep_buffers, "must be true or false")
        async with self._lock:
            if self._session is not None and self._session.is_open:
                raise RefitError(f"a colocated refit is open on this worker (session"
                                 f" {self._session.session_id!r}, bucket {self._session.next_index}"
                                 f" of {self._session.buckets} next): finish or abort it first")
            self._check(manifest, body.get("weight_version"))
            session = ColocatedSession.begin(body.get("session"), manifest,
                                             self._target.weight_version(),
                                             body.get("weight_version"))
            await self._target.begin_colocated(manifest, mode=mode, keep_buffers=keep_buffers)
            self._session, self._started = session, self._clock.monotonic()
            self._arm(session)
        return {"session": session.session_id, "buckets": session.buckets,
                "slot_bytes": manifest.slot_bytes, "bound_bytes": manifest.bound_bytes}

    async def bucket(self, body: Mapping[str, Any]) -> dict[str, Any]:
        body = _mapping(body)
        seconds = await self._load(body, [body],
                                   lambda taken: self._target.load_colocated_bucket(*taken[0]))
        return {"index": body.get("index"), "seconds": seconds}

    async def buckets(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Several buckets in one call, in order, each as ``bucket`` takes it: for a sender
        whose buffers are not reused within a refit (the trainer's tensors held in place),
        so no bucket needs an answer before the next is sent."""
        body = _mapping(body)
        parts = body.get("buckets")
        if not isinstance(parts, list) or not parts:
            raise InvalidValue("buckets", parts, "must be a non-empty list of buckets")
        seconds = await self._load(body, parts, self._target.load_colocated_buckets)
        return {"indices": [part.get("index") for part in parts], "seconds": seconds}

    async def _load(self, body: Mapping[str, Any], parts: list[Any],
                    load: Callable[[list[tuple[Any, BufferHandle]]], Awaitable[None]]) -> float:
        """Take ``parts`` (each a bucket's index, tensors and handle) in the session's order,
        then ``load`` them; a failure ends the session. The seconds the load took."""
        async with self._lock:
            session = self._current(body)
            was_open = session.is_open
            where = "buckets"
            try:
                taken = []
                for part in parts:
                    part = _mapping(part)
                    where = f"bucket {part.get('index')!r}"
                    handle = BufferHandle.from_wire(part.get("handle"))
                    taken.append((session.take_bucket(part.get("index"), part.get("tensors"),
                                                      handle), handle))
                if len(taken) > 1:
                    where = f"buckets {parts[0].get('index')!r}..{parts[-1].get('index')!r}"
                started = self._clock.monotonic()
                await load(taken)
            except BaseException as error:
                await self._failed(session, was_open, f"{where}: {error}")
                raise
            self._arm(session)
        return round(self._clock.monotonic() - started, 6)

    async def finish(self, body: Mapping[str, Any]) -> dict[str, Any]:
        body = _mapping(body)
        async with self._lock:
            session = self._current(body)
            was_open = session.is_open
            try:
                wanted = session.check_finish()
                self._disarm()
                version = await self._target.end_colocated(version=wanted)
            except BaseException as error:
                await self._failed(session, was_open, f"finish: {error}")
                raise
        return {"weight_version": version, "buckets": session.buckets,
                "seconds": round(self._clock.monotonic() - self._started, 6),
                "stats": dict(self._target.colocated_stats())}

    async def _failed(self, session: ColocatedSession, was_open: bool, reason: str) -> None:
        """A step failed: the engine recovers once, when this step ended the session."""
        session.fail(reason)
        if was_open:
            self._disarm()
            await self._target.abandon_colocated(reason)

    async def abort(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Give up the open session (any, or the one named): the engine recovers."""
        body = _mapping(body)
        async with self._lock:
            session = self._session
            if session is None or not session.is_open:
                return {"aborted": None}
            if body.get("session") is not None:
                session.check_session(body.get("session"))
            reason = str(body.get("reason") or "the trainer aborted the refit")
            session.fail(reason)
            self._disarm()
            await self._target.abandon_colocated(reason)
        return {"aborted": session.session_id}

    async def release(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The trainer's sender is done with its buffers: the engine closes those it kept open
        across refits (``keep_buffers``). Refused while a refit is open (it reads them)."""
        _mapping(body)
        async with self._lock:
            session = self._session
            if session is not None and session.is_open:
                raise RefitError(f"a colocated refit is open on this worker (session"
                                 f" {session.session_id!r}): finish or abort it before its"
                                 " buffers are released")
            await self._target.release_colocated()
        return {"released": True}

    def _check(self, manifest: ColocatedManifest, version: Any) -> None:
        metas = self._target.weight_metas()
        if self._checked != (manifest, metas):
            self._checked = None
            check_manifest(self._target, manifest, version, metas)
            self._checked = (manifest, metas)
        else:
            check_manifest(self._target, manifest, version, metas, tensors=False)

    def _current(self, body: Mapping[str, Any]) -> ColocatedSession:
        session = self._session
        if session is None:
            raise RefitError("no colocated refit was started on this worker")
        session.check_session(body.get("session"))
        return session

    def _arm(self, session: ColocatedSession) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_later(self._idle_timeout_s,
                                       lambda: asyncio.ensure_future(self._expire(session)))

    def _disarm(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _expire(self, session: ColocatedSession) -> None:
        async with self._lock:
            if self._session is not session or not session.is_open:
                return
            reason = (f"no call for {self._idle_timeout_s:g} s after bucket {session.next_index}"
                      f" of {session.buckets}: the trainer is gone")
            session.fail(reason)
            self._expiry = None
            await self._target.abandon_colocated(reason)


def check_manifest(target: ColocatedTarget, manifest: ColocatedManifest, version: Any = None,
                   metas: Mapping[str, Any] | None = None, *, tensors: bool = True) -> None:
    """Refuse, before anything loads, a transport the engine cannot open, tensors it does not
    have (names, shapes, dtypes; ``metas``, else the target's: unless ``tensors`` is false, for
    a manifest already checked against them) and a version that would not go up."""
    transports = tuple(target.colocated_transports())
    if manifest.transport not in transports:
        raise InvalidValue("manifest.transport", manifest.transport,
                           f"this worker's engine opens {', '.join(transports)} handles")
    if tensors:
        manifest.info.check_against(target.weight_metas() if metas is None else metas)
    next_version(target.weight_version(), version)


def _mapping(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidValue("control body", body, "must be an object")
    return body
