"""The driver's metric timelines: a worker left out gets no point afterwards, not even from a
sample that was already in flight when it was left out (a CI flake once showed one)."""

import threading
import time

from rollout_fleet.adapters.memory import EngineWorkerMetrics, MemoryEngine
from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.adapters.nemo_rl.worker_metrics import MetricTimelines

ONE_SAMPLE_ONLY_S = 3600.0  # the periodic sampler's interval: it samples once, then waits


def test_a_worker_left_out_mid_sample_gets_no_point_from_that_sample():
    helper = LoopThread("metrics-test", timeout_s=None)
    sources = [EngineWorkerMetrics(f"worker-{i}", MemoryEngine(i)) for i in range(2)]
    timelines = MetricTimelines(sources, helper, interval_s=ONE_SAMPLE_ONLY_S)
    hold, holding = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        holding.set()
        hold.wait(30)

    try:
        # With the loop held, queue the sampler's start (its first step runs one loop turn
        # later) and, one turn later too but after it, the leaving out: the sample asks both
        # workers, then worker-1 is left out before their answers are recorded.
        loop = helper.loop
        loop.call_soon_threadsafe(hold_the_loop)
        assert holding.wait(30)
        timelines.start()
        loop.call_soon_threadsafe(loop.call_soon, timelines.keep_only, ["worker-0"])
        hold.set()
        for _ in range(300):
            if timelines.timelines()["inflight_requests"]["worker-0"]:
                break
            time.sleep(0.01)
        points = timelines.timelines()
        assert [len(points["inflight_requests"][w]) for w in ("worker-0", "worker-1")] == [1, 0]
    finally:
        hold.set()
        timelines.stop()
        helper.close()
