"""Folders of the workers' own (``WorkerLaunch.folder_env``), kept by the placement that starts
them: made on the worker's node before it starts, removed with whatever is left in them once it
is gone. What a worker's processes leave in such a folder (the socket files of an engine core
killed with SIGKILL) goes with it, which a worker killed itself cannot see to."""

from __future__ import annotations

import shutil
import tempfile


class WorkerFolders:
    def __init__(self) -> None:
        self._folders: dict[str, str] = {}  # worker name -> its folder

    def make(self, name: str, variable: str) -> dict[str, str]:
        """The environment naming worker ``name``'s new folder in ``variable``; none without
        a variable."""
        if not variable:
            return {}
        self.remove(name)  # a worker started again under its name gets a fresh one
        self._folders[name] = tempfile.mkdtemp(prefix="rollout-fleet-worker-")
        return {variable: self._folders[name]}

    def remove(self, name: str) -> None:
        folder = self._folders.pop(name, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def remove_all(self) -> None:
        for name in list(self._folders):
            self.remove(name)
