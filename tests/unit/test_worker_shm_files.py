"""A worker killed with its whole process group leaves its /dev/shm files (its multiprocessing
resource tracker dies with it, and vLLM's tensor-parallel buffers stay); the placement's watch
removes the ones the worker's processes used, matched by inode (a semaphore's creator maps it
under a temporary name), and nothing else. Real processes, real POSIX semaphores and segments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rollout_fleet.adapters.shared.processes import signal_group
from rollout_fleet.adapters.shared.shm import (
    WORKER_FILE_PREFIXES, SegmentWatch, SharedMemoryTracker,
)

WORKER = """
import multiprocessing, os, sys
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, kept until exit
segment = open("/dev/shm/psm_" + sys.argv[1], "w+b")  # a queue-like segment, held open
segment.truncate(4096)
ranks = open("/dev/shm/vllm_dist_" + sys.argv[1] + "-tp:0-[0-1]-cpushm_0", "w+b")  # a TP buffer
ranks.truncate(4096)
print(lock._semlock.name, flush=True)
sys.stdin.readline()
"""


def test_the_semaphores_and_segments_of_a_killed_worker_group_are_removed_and_only_those():
    tag = f"test{os.getpid()}"
    stranger = f"/dev/shm/sem.mp-{tag}stranger"  # another program's: never seen in the worker
    open(stranger, "wb").close()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, tag], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, process_group=0)
    try:
        semaphore = "/dev/shm/sem." + worker.stdout.readline().strip().lstrip("/")
        assert os.path.exists(semaphore)
        tracker = SharedMemoryTracker(worker.pid, prefix=WORKER_FILE_PREFIXES)
        tracker.scan()
        ranks = f"/dev/shm/vllm_dist_{tag}-tp:0-[0-1]-cpushm_0"
        assert set(tracker.seen) == {semaphore, f"/dev/shm/psm_{tag}", ranks}
        signal_group(worker.pid, signal.SIGKILL)  # its resource tracker goes with it
        worker.wait()
        time.sleep(0.2)
        assert os.path.exists(semaphore), "nothing else removed it: the leak is real"
        assert sorted(tracker.remove_all()) == sorted([semaphore, f"/dev/shm/psm_{tag}", ranks])
        assert not os.path.exists(semaphore) and os.path.exists(stranger)
    finally:
        if worker.poll() is None:
            signal_group(worker.pid, signal.SIGKILL)
            worker.wait()
        worker.stdin.close()
        worker.stdout.close()
        for path in (stranger, f"/dev/shm/psm_{tag}"):
            if os.path.exists(path):
                os.unlink(path)


def test_a_watch_scans_only_the_named_workers_processes_when_one_is_named():
    """Before one worker of many is killed, only its processes' maps and files are read."""
    tags = {name: f"test{os.getpid()}{name}" for name in ("a", "b")}
    workers = {name: subprocess.Popen([sys.executable, "-c", WORKER, tag], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, process_group=0)
               for name, tag in tags.items()}
    watch = SegmentWatch(interval_s=3600.0)  # no scan of its own while the test runs
    try:
        for worker in workers.values():
            worker.stdout.readline()  # its files are made
        trackers = {name: watch.track(name, worker.pid) for name, worker in workers.items()}
        watch.scan("a")
        assert f"/dev/shm/psm_{tags['a']}" in trackers["a"].seen and trackers["b"].seen == {}
        watch.scan()
        assert f"/dev/shm/psm_{tags['b']}" in trackers["b"].seen
    finally:
        watch.close()
        for name, worker in workers.items():
            signal_group(worker.pid, signal.SIGKILL)
            worker.wait()
            worker.stdin.close()
            worker.stdout.close()
            watch.release(name)  # what each left, removed
