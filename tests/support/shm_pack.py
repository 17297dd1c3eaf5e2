"""A standard-library trainer end for colocated refits of the memory engine: float32 lists
packed into shared-memory segments at the plan's offsets (no torch), for tests that run the
trainer in the test process."""

from __future__ import annotations

import array
import itertools

from rollout_fleet.adapters.shared.segments import Segment, new_segment_name
from rollout_fleet.core.colocated_refit import (
    SHM_TRANSPORT,
    BufferHandle,
    ColocatedManifest,
    bucket_entries_wire,
)
from rollout_fleet.core.refit import Bucket

_sessions = itertools.count()


class ListPool:
    """``num_buffers`` segments of the manifest's slot size; ``pack(bucket, state, slot)``."""

    def __init__(self, manifest: ColocatedManifest) -> None:
        self.manifest = manifest
        self.segments = [Segment.create(new_segment_name(slot), manifest.slot_bytes)
                         for slot in range(manifest.num_buffers)]

    def pack(self, bucket: Bucket, state, slot: int) -> BufferHandle:
        segment = self.segments[slot]
        for entry in bucket.entries:
            values = array.array("f", [x for row in state[entry.meta.name] for x in row])
            raw = values.tobytes()
            segment.view[entry.offset:entry.offset + len(raw)] = raw
        return BufferHandle(SHM_TRANSPORT, slot, segment.nbytes, name=segment.name)

    def close(self) -> None:
        for segment in self.segments:
            segment.close()


def bucket_body(session: str, index: int, bucket: Bucket, handle: BufferHandle) -> dict:
    return {"session": session, "index": index, "tensors": bucket_entries_wire(bucket),
            "handle": handle.to_wire()}


def new_session_id() -> str:
    return f"test-session-{next(_sessions)}"
