"""The colocated refit protocol (``rollout-fleet-colocated-v1``): a trainer on the same device
as a worker's engine hands it its tensors through shared buffers instead of a collective.

The trainer allocates ``num_buffers`` buffers once, each the size of the plan's largest bucket
(the packed protocol's plan, ``core.refit.plan_buckets``: the same buckets, offsets and 256-byte
alignment), fills one, and hands the engine a handle to it (a named shared-memory segment on
the CPU, a CUDA IPC handle on a GPU) with the bucket's manifest. The engine copies each tensor
into its parameter, lets go of every view into the buffer, and answers; then the trainer may
reuse that buffer. So no second copy of the model exists on either side: the buffers, plus
what the engine's loader holds for the layer in progress.

One refit is a session, driven over the worker's control routes:

    colocated_start    the manifest (refit info, buffer geometry, transport): checked against
                       the engine's parameters and version before anything is loaded
    colocated_bucket   bucket k (k = 0, 1, ... in order) and the handle of the buffer holding it
    colocated_finish   every bucket loaded: prefix cache reset, weight version up (or the
                       fleet's), as every other refit
    colocated_abort    the trainer gives up; the engine recovers as from a failed transfer

A sender whose buffers outlive the refit says so at start (``keep_buffers``): the engine may
keep their handles open until ``colocated_release`` (between sessions), when the sender is done.

This module holds the values and the order (``ColocatedSession``: a pure state machine);
``core.colocated_service`` runs them against an engine.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import attrs
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import (
    Bucket,
    RefitInfo,
    RefitProtocol,
    max_bucket_bytes,
    next_version,
    plan_buckets,
)
from rollout_fleet.core.validate import Vocabulary, is_int, one_of, positive_int

SHM_TRANSPORT = "shm"  # a named POSIX shared-memory segment (CPU)
CUDA_TRANSPORT = "cuda"  # a CUDA IPC handle of the buffer's storage (GPU)
TRANSPORTS = (SHM_TRANSPORT, CUDA_TRANSPORT)
# Segments of this protocol carry this prefix; an engine opens no other name (vLLM's own
# queues and anything else in /dev/shm stay out of reach of a control call).
SEGMENT_PREFIX = "rollout-fleet-colocated-"
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_CUDA_FIELDS = ("device_uuid", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
                "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")


class ColocatedStep(Vocabulary):
    """A step of the colocated refit as a worker hands it to each of its engine's ranks (the
    key of ``{"colocated": {step: body}}`` in vLLM's ``update_weights``)."""

    BEGIN = "begin"  # the refit info, the tensors not to load and the rollback
    BUCKET = "bucket"  # one bucket's tensors and offsets, and the handle of its buffer
    BUCKETS = "buckets"  # several buckets in order, each as a BUCKET's body (one request)
    END = "end"  # every bucket sent: check that every tensor arrived
    ABORT = "abort"  # the refit gave up (the reason): recover the weights


def _colocated_protocol(value: Any) -> RefitProtocol:
    return RefitProtocol.parse(value, "protocol", (RefitProtocol.COLOCATED,))


@attrs.frozen
class ColocatedManifest:
    """What ``colocated_start`` carries: the tensors in wire order and the buffers' geometry."""

    info: RefitInfo
    buffer_bytes: int = attrs.field(validator=positive_int("buffer_bytes"))
    num_buffers: int = attrs.field(validator=positive_int("num_buffers"))
    transport: str = attrs.field(validator=one_of("transport", TRANSPORTS))
    protocol: RefitProtocol = attrs.field(
        default=RefitProtocol.COLOCATED,
        converter=_colocated_protocol)

    @functools.cached_property
    def plan(self) -> tuple[Bucket, ...]:
        return plan_buckets(self.info.tensors, self.buffer_bytes)

    @property
    def slot_bytes(self) -> int:
        """The size of each buffer: the plan's largest bucket (as the packed receiver sizes
        its blocks), so any buffer holds any bucket."""
        return max(1, max_bucket_bytes(self.plan))

    @property
    def bound_bytes(self) -> int:
        """The buffers' bytes: the most either side holds for the transfer itself."""
        return self.num_buffers * self.slot_bytes

    def to_wire(self) -> dict[str, Any]:
        return {"protocol": self.protocol.value, "refit_info": self.info.to_wire(),
                "buffer_bytes": self.buffer_bytes, "num_buffers": self.num_buffers,
                "transport": self.transport}

    @classmethod
    def from_wire(cls, data: Any) -> "ColocatedManifest":
        known = {"protocol", "refit_info", "buffer_bytes", "num_buffers", "transport"}
        if not isinstance(data, Mapping):
            raise InvalidValue("manifest", data, "must be an object")
        unknown = sorted(set(data) - known)
        missing = sorted(known - {"protocol"} - set(data))
        if unknown or missing:
            raise InvalidValue("manifest", unknown or missing,
                               "unknown keys" if unknown else "missing keys")
        return cls(RefitInfo.from_wire(data["refit_info"]), data["buffer_bytes"],
                   data["num_buffers"], data["transport"], data.get("protocol", RefitProtocol.COLOCATED))


@attrs.frozen
class BufferHandle:
    """How the engine reaches one of the trainer's buffers: a shared-memory segment by name,
    or a CUDA IPC handle (``cuda``: the fields torch's CUDA IPC rebuild needs, bytes as
    base64 text, and the trainer's GPU by UUID)."""

    transport: str = attrs.field(validator=one_of("handle.transport", TRANSPORTS))
    slot: int = attrs.field(validator=attrs.validators.instance_of(int))
    nbytes: int = attrs.field(validator=positive_int("handle.nbytes"))
    name: str | None = None
    cuda: Mapping[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.slot, bool) or self.slot < 0:
            raise InvalidValue("handle.slot", self.slot, "must be an int >= 0")
        if self.transport == SHM_TRANSPORT:
            name = self.name
            if not isinstance(name, str) or not _SEGMENT_NAME.match(name) \
                    or not name.startswith(SEGMENT_PREFIX):
                raise InvalidValue("handle.name", name, f"a segment name starting with"
                                   f" {SEGMENT_PREFIX!r} (letters, digits, '_', '.', '-')")
        elif not isinstance(self.cuda, Mapping) or set(self.cuda) != set(_CUDA_FIELDS):
            raise InvalidValue("handle.cuda", self.cuda, f"must carry exactly {list(_CUDA_FIELDS)}")

    def to_wire(self) -> dict[str, Any]:
        wire = {"transport": self.transport, "slot": self.slot, "nbytes": self.nbytes}
        if self.name is not None:
            wire["name"] = self.name
        if self.cuda is not None:
            wire["cuda"] = dict(self.cuda)
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> "BufferHandle":
        if not isinstance(data, Mapping):
            raise InvalidValue("handle", data, "must be an object")
        keys = [field.name for field in attrs.fields(cls)]
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise InvalidValue("handle", unknown, "unknown keys")
        # each field checked as the handle is built: a missing one is refused as None
        fields: dict[str, Any] = {key: data.get(key) for key in keys}
        return cls(**fields)


def bucket_entries_wire(bucket: Bucket) -> list[list[Any]]:
    """A bucket's manifest on the wire: ``[name, offset]`` per tensor (shapes and dtypes are
    the start's refit info)."""
    return [[e.meta.name, e.offset] for e in bucket.entries]


def _check_entries(index: int, expected: Bucket, given: Any) -> None:
    """The bucket's manifest is the plan's bucket ``index``, tensor by tensor."""
    if not isinstance(given, list):
        raise InvalidValue(f"bucket {index} tensors", given, "must be a list of [name, offset]")
    wanted = bucket_entries_wire(expected)
    if given == wanted:  # the usual case, compared at once; else found and named below
        return
    for position, (want, got) in enumerate(zip(wanted, given)):
        if not isinstance(got, (list, tuple)) or list(got) != want:
            raise InvalidValue(f"bucket {index} tensor {position}", got,
                               f"the plan puts {want[0]!r} at offset {want[1]} here")
    if len(given) != len(wanted):
        raise InvalidValue(f"bucket {index} tensors", f"{len(given)} tensors",
                           f"the plan's bucket {index} holds {len(wanted)}")


OPEN, FAILED, FINISHED = "open", "failed", "finished"


@attrs.define
class ColocatedSession:
    """One colocated refit on a worker: start -> bucket 0 .. n-1 in order -> finish.

    Pure: it checks each step against the plan and says what is next; the caller loads. A
    refused step fails the session (a trainer that sends out of order is not to be trusted
    with the rest), and every later step is refused naming the first failure.
    """

    session_id: str
    manifest: ColocatedManifest
    wanted_version: int | None = None
    plan: tuple[Bucket, ...] = attrs.field(init=False)
    state: str = attrs.field(init=False, default=OPEN)
    next_index: int = attrs.field(init=False, default=0)
    failure: str | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise InvalidValue("session", self.session_id, "must be a non-empty string")
        if self.wanted_version is not None and (not is_int(self.wanted_version)
                                                or self.wanted_version < 1):
            raise InvalidValue("weight_version", self.wanted_version, "must be None or an int >= 1")
        self.plan = self.manifest.plan

    @classmethod
    def begin(cls, session_id: Any, manifest: ColocatedManifest, current_version: int,
              wanted_version: Any = None) -> "ColocatedSession":
        """A session, once the version it would set is known to go up (``session_id`` and
        ``wanted_version`` as a control body carries them: checked here)."""
        next_version(current_version, wanted_version)
        return cls(session_id, manifest, wanted_version)

    @property
    def buckets(self) -> int:
        return len(self.plan)

    def check_session(self, session_id: Any) -> None:
        if session_id != self.session_id:
            raise RefitError(f"session {session_id!r} is not the colocated refit open on this"
                             f" worker ({self.session_id!r})")

    def take_bucket(self, index: Any, entries: Any, handle: BufferHandle) -> Bucket:
        """Bucket ``index`` may be loaded from ``handle``: it is the next one, its manifest is
        the plan's, and the buffer holds it. Anything else fails the session."""
        self._check_open(f"bucket {index!r}")
        try:
            if not is_int(index) or index != self.next_index:
                raise RefitError(f"bucket {index!r} out of order: bucket {self.next_index} of"
                                 f" {self.buckets} is next")
            bucket = self.plan[index]
            _check_entries(index, bucket, entries)
            self._check_handle(index, bucket, handle)
        except (RefitError, InvalidValue) as error:
            self.fail(str(error))
            raise
        self.next_index += 1
        return bucket

    def _check_handle(self, index: int, bucket: Bucket, handle: BufferHandle) -> None:
        if handle.transport != self.manifest.transport:
            raise InvalidValue("handle.transport", handle.transport,
                               f"the session's transport is {self.manifest.transport}")
        if handle.slot >= self.manifest.num_buffers:
            raise InvalidValue("handle.slot", handle.slot,
                               f"the session has {self.manifest.num_buffers} buffers")
        if handle.nbytes < bucket.nbytes:
            raise InvalidValue("handle.nbytes", handle.nbytes,
                               f"bucket {index} needs {bucket.nbytes} bytes")

    def check_finish(self) -> int | None:
        """Every bucket came; the version the finish sets (None: the engine's next)."""
        self._check_open("finish")
        if self.next_index != self.buckets:
            error = RefitError(f"finish after {self.next_index} of {self.buckets} buckets")
            self.fail(str(error))
            raise error
        self.state = FINISHED
        return self.wanted_version

    def fail(self, reason: str) -> None:
        """The session ends failed (the first reason is kept); a commit that failed after
        ``check_finish`` fails it too."""
        if self.state != FAILED:
            self.state, self.failure = FAILED, reason

    @property
    def is_open(self) -> bool:
        return self.state == OPEN

    def _check_open(self, step: str) -> None:
        if self.state == FAILED:
            raise RefitError(f"{step} refused: colocated refit {self.session_id!r} failed"
                             f" earlier ({self.failure}); start a new one")
        if self.state == FINISHED:
            raise RefitError(f"{step} refused: colocated refit {self.session_id!r} is finished")
