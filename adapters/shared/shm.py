"""Shared-memory files that a worker's processes leave in /dev/shm.

vLLM's message queues between its processes are Python ``SharedMemory`` segments
(``/dev/shm/psm_*``). A killed engine core, and at times a clean exit, leaves its segment
behind (~160 MiB); so, at times, do the shared buffers of vLLM's CPU tensor-parallel
communicator (``/dev/shm/vllm_dist_*``, one per rank); a killed worker leaves the named
semaphores of Python's multiprocessing (``sem.mp-*``), which its resource tracker, killed with
it, would have removed. A tracker records the files a worker's processes map or hold open
while they live (by inode, from ``/proc/<pid>/maps`` and ``/proc/<pid>/fd``: a semaphore's
creator maps it under a temporary name) and removes those that remain once no process of the
worker uses them. It never removes a file it did not see in the worker's processes, nor one
that was replaced by another of the same name since (the inode must match).
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Collection, Iterator

from rollout_fleet.adapters.shared.processes import open_file_links

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "psm_"  # vLLM's queues
SEMAPHORE_PREFIX = "sem.mp-"  # multiprocessing's named semaphores
TENSOR_PARALLEL_PREFIX = "vllm_dist_"  # vLLM's CPU all-reduce buffers between its ranks
WORKER_FILE_PREFIXES = (SEGMENT_PREFIX, SEMAPHORE_PREFIX, TENSOR_PARALLEL_PREFIX)


class SharedMemoryTracker:
    """The segments of one worker: the process group it leads and every descendant."""

    def __init__(self, root_pid: int, *, remove_unused: bool = True, shm_dir: str = SHM_DIR,
                 prefix: str | tuple[str, ...] = SEGMENT_PREFIX) -> None:
        self.root_pid = root_pid
        self._remove_unused = remove_unused
        self._dir = shm_dir.rstrip("/") + "/"
        self._prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
        self._seen: dict[str, int] = {}  # path -> inode, while the worker used it
        self._unused_once: set[str] = set()
        self._lock = threading.Lock()

    @property
    def seen(self) -> dict[str, int]:
        with self._lock:
            return dict(self._seen)

    def scan(self, table: ProcessTable | None = None) -> None:
        """Record what the worker's processes use now, and (``remove_unused``) remove a recorded
        segment that no process of the worker has used in two scans in a row (its engine core
        died). ``table``: the processes as read for several trackers at once."""
        in_use = self.in_use(table)
        with self._lock:
            self._seen.update(in_use)
            if not self._remove_unused:
                return
            unused = set(self._seen) - set(in_use)
            for path in unused & self._unused_once:
                self._remove(path)
            self._unused_once = unused - self._unused_once

    def in_use(self, table: ProcessTable | None = None) -> dict[str, int]:
        """path -> inode of the tracked files that the worker's processes use now."""
        named = self._named_files()
        in_use: dict[str, int] = {}
        table = table if table is not None else ProcessTable()
        for pid in table.worker_processes(self.root_pid):
            in_use.update((named[inode], inode) for inode in _shm_inodes(pid, self._dir)
                          if inode in named)
        return in_use

    def remove_all(self, keep: Collection[str] = ()) -> list[str]:
        """Once the worker has stopped: remove every recorded segment still there (but
        ``keep``)."""
        with self._lock:
            removed = [path for path in list(self._seen)
                       if path not in keep and self._remove(path)]
            self._unused_once.clear()
        return removed

    def _remove(self, path: str) -> bool:
        inode = self._seen.pop(path)
        try:
            if os.stat(path).st_ino != inode:
                return False  # another file of the same name since: not the worker's
            os.unlink(path)
        except OSError:
            return False  # already gone (vLLM removes its own on a clean exit)
        return True

    def _named_files(self) -> dict[int, str]:
        """inode -> path of the tracked files in the folder now."""
        named: dict[int, str] = {}
        try:
            entries = list(os.scandir(self._dir))
        except OSError:
            return named
        for entry in entries:
            if entry.name.startswith(self._prefixes):
                try:
                    named[entry.inode()] = entry.path
                except OSError:
                    continue
        return named


def _shm_inodes(pid: int, shm_dir: str) -> set[int]:
    """The inodes of the files under ``shm_dir`` that process ``pid`` maps or holds open, by
    whatever name it got them (an unlinked temporary one included)."""
    inodes: set[int] = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(shm_dir):
                    inodes.add(int(fields[4]))
    except OSError:
        pass  # gone meanwhile
    for fd, target in open_file_links(pid):
        if target.startswith(shm_dir):
            try:
                inodes.add(os.stat(fd).st_ino)
            except OSError:
                continue  # closed meanwhile
    return inodes


class SegmentWatch:
    """Scans a set of trackers every ``interval_s`` on a daemon thread until ``close``."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self._trackers: dict[str, SharedMemoryTracker] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._interval_s = interval_s
        self._thread: threading.Thread | None = None

    def track(self, name: str, root_pid: int) -> SharedMemoryTracker:
        tracker = SharedMemoryTracker(root_pid, prefix=WORKER_FILE_PREFIXES)
        with self._lock:
            self._trackers[name] = tracker
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shm-watch", daemon=True)
                self._thread.start()
        return tracker

    def scan(self, name: str | None = None) -> None:
        """Every tracker, or only worker ``name``'s (a scan reads each of its processes' maps
        and open files: before one of 128 workers is killed, the other 127 need none). The
        process table is read once for all of them."""
        with self._lock:
            trackers = list(self._trackers.values()) if name is None \
                else [self._trackers[name]] if name in self._trackers else []
        table = ProcessTable()
        for tracker in trackers:
            tracker.scan(table)

    def release(self, name: str) -> list[str]:
        """The worker ``name`` has stopped: remove what it left, stop tracking it."""
        with self._lock:
            tracker = self._trackers.pop(name, None)
        return tracker.remove_all() if tracker is not None else []

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._closed.clear()

    def _run(self) -> None:
        while not self._closed.wait(self._interval_s):
            self.scan()


class ProcessTable:
    """Every live process's parent and group, read from /proc once, indexed so that the
    processes of each of many workers are found without reading it again."""

    def __init__(self) -> None:
        self._live: set[int] = set()
        self._children: dict[int, list[int]] = defaultdict(list)
        self._members: dict[int, list[int]] = defaultdict(list)  # process group -> its pids
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _stat(int(entry))
                if stat is not None:
                    pid, (parent, group) = int(entry), stat
                    self._live.add(pid)
                    self._children[parent].append(pid)
                    self._members[group].append(pid)

    def worker_processes(self, root_pid: int) -> list[int]:
        """``root_pid``, the members of the process group it leads, and all their descendants
        (a child whose parent died is still in the group)."""
        found = ({root_pid} & self._live) | set(self._members.get(root_pid, ()))
        frontier = list(found)
        while frontier:
            for child in self._children.get(frontier.pop(), ()):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
        return sorted(found)


def worker_processes(root_pid: int) -> Iterator[int]:
    """``ProcessTable.worker_processes`` of the processes now."""
    return iter(ProcessTable().worker_processes(root_pid))


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group) of a live process, None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[2]))
