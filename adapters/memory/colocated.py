"""The memory engine's side of the colocated refit: it opens the trainer's shared-memory
segments as the vLLM engine does on the CPU, reads each bucket's float32 tensors out of them,
and commits them with the same swap as a collective refit (cache reset, version)."""

from __future__ import annotations

from typing import Any

from rollout_fleet.adapters.shared.segments import Segment
from rollout_fleet.core.colocated_refit import SHM_TRANSPORT, BufferHandle, ColocatedManifest
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import Bucket, BucketEntry
from rollout_fleet.ports.colocated import ColocatedTarget

COLOCATED_TP_RULE = ("a colocated refit hands the trainer's buffers to the one engine rank on"
                     " the trainer's device; with more ranks each lives on its own device and"
                     " needs its own slice (the sharded protocol's job): tensor parallel 1 only")


class MemoryColocated(ColocatedTarget):
    """Mixed into ``MemoryEngine``: stages each bucket, swaps at the end (as its collective
    refit does), so a session given up half way changes nothing."""

    _colocated: dict[str, Any] | None = None

    def colocated_transports(self) -> tuple[str, ...]:
        return (SHM_TRANSPORT,)

    async def begin_colocated(self, manifest: ColocatedManifest, *, mode: str) -> None:
        if self.refit_ranks() != 1:
            raise InvalidValue("refit_ranks", self.refit_ranks(), COLOCATED_TP_RULE)
        self._check_refit_allowed([t.name for t in manifest.info.tensors])  # as any refit, asleep
        self._colocated = {"mode": mode, "staged": {}, "bytes": 0, "peak_open": 0}

    async def load_colocated_bucket(self, bucket: Bucket, handle: BufferHandle) -> None:
        state = self._session_state()
        metas = self.weight_metas()
        segment = Segment.open(handle.name, handle.nbytes)
        state["peak_open"] = max(state["peak_open"], handle.nbytes)
        try:
            for entry in bucket.entries:
                rows = _rows(segment, entry)
                state["staged"][entry.meta.name] = self._matrix(entry.meta.name, rows, metas)
                state["bytes"] += entry.meta.nbytes
        finally:
            segment.close()

    async def end_colocated(self, *, version: int | None) -> int:
        state = self._session_state()
        self._colocated = None
        self.colocated_last = {"bytes": state["bytes"], "open_bytes_peak": state["peak_open"]}
        return await self._swap_weights(state["staged"], state["mode"], version)

    async def abandon_colocated(self, reason: str) -> None:
        self._colocated = None

    def colocated_stats(self) -> dict[str, Any]:
        return dict(getattr(self, "colocated_last", {}))

    def _session_state(self) -> dict[str, Any]:
        if self._colocated is None:
            raise RefitError("no colocated refit begun on this engine")
        return self._colocated


def _rows(segment: Segment, entry: BucketEntry) -> list[list[float]]:
    """The float32 tensor at ``entry`` as rows (the memory model's matrices are 2-D)."""
    meta = entry.meta
    if meta.dtype != "float32" or len(meta.shape) != 2:
        raise InvalidValue(f"dtype of {meta.name!r}", meta.dtype, "the memory engine holds 2-D float32")
    with segment.view[entry.offset:entry.offset + meta.nbytes] as raw, raw.cast("f") as floats:
        values = floats.tolist()
    cols = meta.shape[1]
    return [values[r * cols:(r + 1) * cols] for r in range(meta.shape[0])]
