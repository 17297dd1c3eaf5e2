"""Named POSIX shared-memory segments (``/dev/shm/<name>``) for colocated refits on the CPU.

The trainer creates a segment per buffer once and unlinks it when it is done (and a new pool
first unlinks the segments of trainers that died without doing so); an engine on the same host
opens one by name, maps it, and closes its mapping when the refit ends. Plain files
under /dev/shm with ``mmap`` rather than ``multiprocessing.shared_memory``: Python 3.11's
class registers every segment it opens with a resource tracker, which unlinks it (and warns)
when the opening process exits, taking the trainer's buffer away. Names carry the protocol's
prefix (``core.colocated_refit.SEGMENT_PREFIX``); the fleet's /dev/shm clean-up (``shm.py``)
watches vLLM's ``psm_`` segments only, so it never removes one of these.
"""

from __future__ import annotations

import mmap
import os
import secrets

from rollout_fleet.adapters.shared.orphans import maker_tag, orphans
from rollout_fleet.core.colocated_refit import SEGMENT_PREFIX
from rollout_fleet.core.errors import InvalidValue, RefitError

SHM_DIR = "/dev/shm"


def new_segment_name(slot: int) -> str:
    """``<prefix><pid>.<pid namespace>-<slot>-<random>``: the sweep judges a creator only
    inside its own pid namespace (containers sharing /dev/shm see other pids)."""
    return f"{maker_tag(SEGMENT_PREFIX)}-{slot}-{secrets.token_hex(6)}"


class Segment:
    """One mapped segment; ``view`` is a writable memoryview of its bytes."""

    def __init__(self, name: str, nbytes: int, fd: int, owner: bool) -> None:
        self.name, self.nbytes, self._owner = name, nbytes, owner
        try:
            self._map: mmap.mmap | None = mmap.mmap(  # None once closed
                fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    @classmethod
    def create(cls, name: str, nbytes: int) -> "Segment":
        """A new segment of ``nbytes`` (only this user may open it); refuses an existing name."""
        _check_name(name)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidValue("nbytes", nbytes, "must be an int >= 1")
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(_path(name))
            raise
        return cls(name, nbytes, fd, owner=True)

    @classmethod
    def open(cls, name: str, nbytes: int) -> "Segment":
        """Map the segment ``name``, which must hold at least ``nbytes``; a ``RefitError``
        naming it when it is gone, too small, or not this user's."""
        _check_name(name)
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise RefitError(f"cannot open shared-memory segment {name!r}: {error.strerror}"
                             " (the trainer's buffer is gone?)") from None
        stat = os.fstat(fd)
        problem = None
        if stat.st_uid != os.getuid():
            problem = "it belongs to another user"
        elif stat.st_size < nbytes:
            problem = f"it holds {stat.st_size} bytes, the handle says {nbytes}"
        if problem:
            os.close(fd)
            raise RefitError(f"cannot use shared-memory segment {name!r}: {problem}")
        return cls(name, nbytes, fd, owner=False)

    def close(self) -> None:
        """Unmap (the caller holds no view into it any more); the owner also unlinks."""
        if self._map is None:
            return
        self.view.release()
        self._map.close()
        self._map = None
        if self._owner:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass

    def unlink(self) -> None:
        try:
            os.unlink(_path(self.name))
        except FileNotFoundError:
            pass


def remove_orphans(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose creating process is gone (a trainer killed by SIGKILL
    cannot unlink its own); returns their names. A live creator's are kept, whoever it is."""
    removed = []
    for entry in orphans(shm_dir, SEGMENT_PREFIX):
        try:
            os.unlink(entry.path)
            removed.append(entry.name)
        except FileNotFoundError:
            pass  # its creator's clean-up, or another sweep, got there first
    return removed


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name.startswith(SEGMENT_PREFIX) or "/" in name \
            or len(name) > 200:
        raise InvalidValue("segment name", name, f"must start with {SEGMENT_PREFIX!r}, no '/'")
