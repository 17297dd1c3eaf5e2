"""The memory engine's side of the colocated refit: it opens the trainer's shared-memory
segments as the vLLM engine does on the CPU, reads each bucket's float32 tensors out of them,
and commits them with the same swap as a collective refit (cache reset, version)."""

from __future__ import annotations

import array
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollout_fleet.adapters.memory.model import BALLAST_PREFIX, as_matrix
from rollout_fleet.adapters.shared.segments import Segment
from rollout_fleet.core.colocated_refit import SHM_TRANSPORT, BufferHandle, ColocatedManifest
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import Bucket, BucketEntry, RefitMode, TensorMeta
from rollout_fleet.ports.colocated import ColocatedTarget

if TYPE_CHECKING:
    from rollout_fleet.adapters.memory.engine import MemoryEngine

COLOCATED_TP_RULE = ("a colocated refit hands the trainer's buffers to the one engine rank on"
                     " the trainer's device; with more ranks each lives on its own device and"
                     " needs its own slice (the sharded protocol's job): tensor parallel 1 only")


class MemoryColocated(ColocatedTarget):
    """The colocated part of ``MemoryEngine``: stages each bucket, and swaps at the end through
    the engine's own refit swap, so a session given up half way changes nothing."""

    def __init__(self, engine: MemoryEngine) -> None:
        self.engine = engine
        self._session: dict[str, Any] | None = None
        self._last: dict[str, Any] = {}

    def weight_metas(self) -> Mapping[str, TensorMeta]:
        return self.engine.weight_metas()

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def colocated_transports(self) -> tuple[str, ...]:
        return (SHM_TRANSPORT,)

    async def begin_colocated(self, manifest: ColocatedManifest, *, mode: RefitMode,
                              keep_buffers: bool = False) -> None:
        # keep_buffers changes nothing here: each bucket's segment is opened for it alone
        ranks = self.engine.refit_ranks()
        if ranks != 1:
            raise InvalidValue("refit_ranks", ranks, COLOCATED_TP_RULE)
        # as any refit: refused while the weights are asleep
        self.engine.sleeper.check_refit_allowed([t.name for t in manifest.info.tensors])
        self._session = {"mode": mode, "staged": {}, "bytes": 0, "peak_open": 0}

    async def load_colocated_bucket(self, bucket: Bucket, handle: BufferHandle) -> None:
        state = self._session_state()
        metas = self.engine.weight_metas()
        if handle.transport != SHM_TRANSPORT or handle.name is None:
            raise InvalidValue("handle.transport", handle.transport,
                               f"the memory engine opens {SHM_TRANSPORT!r} buffers only")
        segment = Segment.open(handle.name, handle.nbytes)
        state["peak_open"] = max(state["peak_open"], handle.nbytes)
        try:
            for entry in bucket.entries:
                name = entry.meta.name
                if not name.startswith(BALLAST_PREFIX):  # carried, not kept
                    state["staged"][name] = as_matrix(name, _rows(segment, entry), metas[name])
                state["bytes"] += entry.meta.nbytes
        finally:
            segment.close()

    async def end_colocated(self, *, version: int | None) -> int:
        state = self._session_state()
        self._session = None
        self._last = {"bytes": state["bytes"], "open_bytes_peak": state["peak_open"]}
        return await self.engine.swap_weights(state["staged"], state["mode"], version)

    async def abandon_colocated(self, reason: str) -> None:
        self._session = None

    def colocated_stats(self) -> dict[str, Any]:
        return dict(self._last)

    def _session_state(self) -> dict[str, Any]:
        if self._session is None:
            raise RefitError("no colocated refit begun on this engine")
        return self._session


def _rows(segment: Segment, entry: BucketEntry) -> list[list[float]]:
    """The float32 tensor at ``entry`` as rows (the memory model's matrices are 2-D)."""
    meta = entry.meta
    if meta.dtype != "float32" or len(meta.shape) != 2:
        raise InvalidValue(f"dtype of {meta.name!r}", meta.dtype, "the memory engine holds 2-D float32")
    floats = array.array("f")
    with segment.view[entry.offset:entry.offset + meta.nbytes] as raw:
        floats.frombytes(raw)
    values, cols = floats.tolist(), meta.shape[1]
    return [values[r * cols:(r + 1) * cols] for r in range(meta.shape[0])]
