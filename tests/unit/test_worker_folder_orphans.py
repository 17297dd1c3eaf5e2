"""Worker folders whose maker is gone (a Ray node lost with its workers): the next placement on
the host removes them; a live maker's, another pid namespace's, and anything not named as a
worker folder, stay. Real folders in a private parent, real processes."""

from __future__ import annotations

import os

from rollout_fleet.adapters.shared.processes import pid_namespace
from rollout_fleet.adapters.shared.worker_folders import (
    FOLDER_PREFIX, WorkerFolders, remove_orphan_folders,
)
from tests.support.processes import dead_pid


def test_a_dead_makers_folders_go_with_what_they_hold_and_the_rest_stay(tmp_path):
    dead, alive, here = dead_pid(), os.getpid(), pid_namespace()
    names = {"dead": f"{FOLDER_PREFIX}{dead}.{here}-abc",
             "alive": f"{FOLDER_PREFIX}{alive}.{here}-def",
             "elsewhere": f"{FOLDER_PREFIX}{dead}.1-abc",  # another pid namespace's
             "unnamed": f"{FOLDER_PREFIX}x7q2",  # no maker in its name
             "other": "rollout-fleet-vllm-1234"}
    for name in names.values():
        (tmp_path / name).mkdir()
    (tmp_path / names["dead"] / "left.sock").write_bytes(b"")
    assert remove_orphan_folders(str(tmp_path)) == [str(tmp_path / names["dead"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for key, n in names.items() if key != "dead")


def test_a_placement_making_a_folder_sweeps_first(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    orphan = tmp_path / f"{FOLDER_PREFIX}{dead_pid()}.{pid_namespace()}-0123"
    orphan.mkdir()
    folders = WorkerFolders()
    made = folders.make("worker-0", "WORKER_FOLDER")["WORKER_FOLDER"]
    assert not orphan.exists()
    assert os.path.basename(made).startswith(f"{FOLDER_PREFIX}{os.getpid()}.{pid_namespace()}-")
    folders.remove_all()
    assert not os.path.exists(made)
