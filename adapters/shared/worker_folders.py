"""Folders of the workers' own (``WorkerLaunch.folder_env``), kept by the placement that starts
them: made on the worker's node before it starts, removed with whatever is left in them once it
is gone. What a worker's processes leave in such a folder (the socket files of an engine core
killed with SIGKILL) goes with it, which a worker killed itself cannot see to.

A folder is named after the process that made it (``adapters.shared.orphans``): one whose maker
died with it (a Ray node lost, the placement's process killed) is removed by the next placement
on that host that makes one."""

from __future__ import annotations

import shutil
import tempfile

from rollout_fleet.adapters.shared.orphans import maker_tag, orphans

FOLDER_PREFIX = "rollout-fleet-worker-"


class WorkerFolders:
    def __init__(self) -> None:
        self._folders: dict[str, str] = {}  # worker name -> its folder

    def make(self, name: str, variable: str) -> dict[str, str]:
        """The environment naming worker ``name``'s new folder in ``variable``; none without
        a variable."""
        if not variable:
            return {}
        self.remove(name)  # a worker started again under its name gets a fresh one
        remove_orphan_folders()
        self._folders[name] = tempfile.mkdtemp(prefix=f"{maker_tag(FOLDER_PREFIX)}-")
        return {variable: self._folders[name]}

    def remove(self, name: str) -> None:
        folder = self._folders.pop(name, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def remove_all(self) -> None:
        for name in list(self._folders):
            self.remove(name)


def remove_orphan_folders(parent: str | None = None) -> list[str]:
    """Remove this user's worker folders in ``parent`` (the temp folder) whose maker is gone,
    with what they hold; returns their paths."""
    removed = []
    for entry in orphans(parent or tempfile.gettempdir(), FOLDER_PREFIX):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed
