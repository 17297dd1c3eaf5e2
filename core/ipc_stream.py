"""NeMo-RL's colocated weight stream, received by a worker (``update_weights_via_ipc_zmq``).

NeMo-RL's trainer rank packs its tensors, in the order it likes, into one of two buffers on
the device it shares with the engine: each tensor at an offset aligned to 512 bytes, a new
group once the next tensor does not fit (a tensor larger than a buffer travels alone in a
buffer of its own size). For each group it sends one message: a handle to the buffer, the
group's tensor names and the bytes used; the engine answers once it holds no view into the
buffer, and the trainer may then refill it. A final message ends the stream and is answered
too. Shapes and dtypes are those of the refit info (``prepare_refit_info``), so each offset
follows from the names alone.

The engine loads each group through the colocated refit port (``ColocatedTarget``: begin, one
load per group, end or abandon), so it commits as every colocated refit does (prefix cache
reset, weight version) and recovers from a failed stream as from a failed refit. Only the
transport differs: the handle (a shared-memory segment on the CPU, a CUDA IPC handle on a
GPU) is decoded by the stream's adapter into the same ``BufferHandle``.

Pure except ``receive_weight_stream``, which drives a ``WeightStream`` (the adapter: pyzmq)
and a ``ColocatedTarget``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import attrs
from rollout_fleet.core.colocated_refit import BufferHandle, ColocatedManifest
from rollout_fleet.core.engine_ports import ColocatedTarget
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.colocated_service import check_manifest
from rollout_fleet.core.refit import Bucket, BucketEntry, RefitInfo, refit_mode

ALIGNMENT = 512  # NeMo-RL's: every tensor starts at a multiple of it in the buffer
STREAM_BUFFERS = 2  # NeMo-RL's ping-pong pair


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


@attrs.frozen
class StreamGroup:
    """One message of the stream: the buffer, the names packed in it in order, the bytes used
    (the end of the last tensor's aligned slot)."""

    handle: BufferHandle
    names: tuple[str, ...]
    used_bytes: int


class WeightStream(ABC):
    """One trainer's stream of groups (NeMo-RL's request/reply messages)."""

    @abstractmethod
    async def next_group(self) -> StreamGroup | None:
        """The next group, or None for the final message. A message that cannot be read is
        an ``InvalidValue`` naming it (the stream still expects an answer to it)."""

    @abstractmethod
    async def answer(self) -> None:
        """Answer the last message: the engine holds no view into its buffer any more."""


@attrs.define
class StreamedRefit:
    """The groups of one stream checked against the refit info: every name known, none twice,
    the offsets NeMo-RL's packing gives, the bytes used as it counts them, and at the end
    every tensor of the info loaded."""

    info: RefitInfo
    loaded: set[str] = attrs.field(factory=set)
    groups: int = 0

    def bucket(self, group: StreamGroup) -> Bucket:
        """Where each tensor of ``group`` lies in its buffer, or ``InvalidValue`` naming why
        the group does not match the refit info."""
        metas = {t.name: t for t in self.info.tensors}
        entries: list[BucketEntry] = []
        offset = 0
        for name in group.names:
            meta = metas.get(name) if isinstance(name, str) else None
            if meta is None:
                raise InvalidValue(f"group {self.groups} tensor", name,
                                   "not in the refit info (prepare_refit_info)")
            if name in self.loaded or any(e.meta.name == name for e in entries):
                raise InvalidValue(f"group {self.groups} tensor", name, "sent twice in one refit")
            entries.append(BucketEntry(meta, offset))
            offset += aligned(meta.nbytes)
        self._check_size(group, offset)
        self.loaded.update(group.names)
        self.groups += 1
        return Bucket(tuple(entries), offset)

    def _check_size(self, group: StreamGroup, end: int) -> None:
        if not group.names:
            raise InvalidValue(f"group {self.groups} tensors", [], "a group carries tensors")
        if group.used_bytes != end:
            raise InvalidValue(f"group {self.groups} used_bytes", group.used_bytes,
                               f"its tensors at {ALIGNMENT}-byte aligned offsets end at {end}:"
                               " the refit info's shapes or dtypes differ from the trainer's")
        if group.handle.nbytes < end:
            raise InvalidValue(f"group {self.groups} buffer", group.handle.nbytes,
                               f"smaller than the {end} bytes its tensors take")

    def missing(self) -> list[str]:
        return [t.name for t in self.info.tensors if t.name not in self.loaded]


def stream_manifest(info: RefitInfo, transport: str) -> ColocatedManifest:
    """The colocated manifest an engine begins a stream with: the refit info and the transport
    (the buffers' geometry is the trainer's to choose, group by group)."""
    return ColocatedManifest(info, max(1, info.total_bytes), STREAM_BUFFERS, transport)


async def receive_weight_stream(stream: WeightStream, target: ColocatedTarget, info: RefitInfo,
                                *, mode: str | None = None, version: int | None = None) -> int:
    """Load every group of ``stream`` into ``target``; the weight version it commits.

    What the engine cannot take (names, shapes, dtypes, a version that does not go up) is
    refused before anything loads, as for every colocated refit. After a refusal or a failure
    every later message is still answered, unloaded, until the final one, so the trainer ends
    at once; the engine serves its previous weights, and the error is raised then."""
    receiving = _Receiving(target, StreamedRefit(info))
    try:
        manifest = stream_manifest(info, target.colocated_transports()[0])
        check_manifest(target, manifest, version)
        await target.begin_colocated(manifest, mode=refit_mode(mode))
    except Exception as error:  # noqa: BLE001 - nothing begun: drained, then raised
        receiving.refused(error)
    try:
        await receiving.every_group(stream)
        if receiving.failure is None:
            committed = await target.end_colocated(version=version)
    except BaseException as error:
        await receiving.abandon(error)
        raise
    finally:
        await stream.answer()  # the final message (or the one that failed): the trainer ends
    if receiving.failure is not None:
        raise RefitError(f"the IPC weight stream failed: {receiving.failure}") \
            from receiving.failure
    return committed


class _Receiving:
    """One stream's groups into the engine; the first failure abandons the refit once."""

    def __init__(self, target: ColocatedTarget, refit: StreamedRefit) -> None:
        self.target, self.refit = target, refit
        self.failure: BaseException | None = None

    async def every_group(self, stream: WeightStream) -> None:
        """Until the final message (left unanswered: the caller answers it once committed)."""
        while True:
            try:
                group = await stream.next_group()
            except InvalidValue as error:
                await self.abandon(error)
                await stream.answer()
                continue
            if group is None:
                break
            if self.failure is None:
                await self._load(group)
            await stream.answer()
        missing = self.refit.missing()
        if missing and self.failure is None:
            await self.abandon(RefitError(f"the stream ended without {len(missing)} tensor(s)"
                                          f" of the refit info, e.g. {missing[:3]}"))

    async def _load(self, group: StreamGroup) -> None:
        try:
            bucket = self.refit.bucket(group)
            await self.target.load_colocated_bucket(bucket, group.handle)
        except Exception as error:  # noqa: BLE001 - answered; raised once the stream ends
            await self.abandon(error)

    def refused(self, error: BaseException) -> None:
        """The engine refused the refit before it began: nothing to abandon."""
        self.failure = error

    async def abandon(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
            await self.target.abandon_colocated(f"group {self.refit.groups}: {error}")
