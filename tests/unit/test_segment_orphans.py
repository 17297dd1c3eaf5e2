"""Shared-memory segments a trainer left when it was killed (it could not unlink them): a new
pool removes them; a live trainer's, another pid namespace's, and anything not named as a
segment, stay. Real files in a
private folder standing in for /dev/shm, real processes."""

from __future__ import annotations

import os

import torch
from rollout_fleet.adapters.collective.colocated import BufferPool
from rollout_fleet.adapters.shared.processes import pid_namespace
from rollout_fleet.adapters.shared.segments import remove_orphans
from rollout_fleet.core.colocated_refit import SEGMENT_PREFIX
from tests.support.processes import dead_pid


def test_segments_of_a_dead_trainer_go_and_a_live_ones_stay(tmp_path):
    dead, alive, here = dead_pid(), os.getpid(), pid_namespace()
    names = {"dead": f"{SEGMENT_PREFIX}{dead}.{here}-0-abc",
             "alive": f"{SEGMENT_PREFIX}{alive}.{here}-0-def",
             "elsewhere": f"{SEGMENT_PREFIX}{dead}.1-0-abc",  # another pid namespace's
             "other": "psm_1234", "odd": f"{SEGMENT_PREFIX}not-a-pid"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 16)
    assert remove_orphans(str(tmp_path)) == [names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for key, n in names.items() if key != "dead")


def test_a_new_shared_memory_pool_sweeps_first():
    orphan = f"/dev/shm/{SEGMENT_PREFIX}{dead_pid()}.{pid_namespace()}-0-0123456789ab"
    with open(orphan, "wb") as out:
        out.write(b"\0" * 16)
    pool = BufferPool(4096, 2, torch.device("cpu"))
    try:
        assert not os.path.exists(orphan)
        assert all(os.path.exists(f"/dev/shm/{pool.handle(s).name}") for s in range(2))
    finally:
        pool.close()
        if os.path.exists(orphan):
            os.unlink(orphan)
