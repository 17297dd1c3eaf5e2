"""The in-memory worker control and metrics pass the worker-control and metrics contracts."""

import pytest

from rollout_fleet.adapters.memory import EngineWorkerMetrics, LocalWorkerControl, MemoryEngine
from rollout_fleet.core.refit_service import WorkerRefit
from rollout_fleet.core.rollout import GREEDY
from rollout_fleet.ports.contracts.control import ControlContract, ControlUnderTest
from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.ports.contracts.metrics import MetricsContract, MetricsUnderTest


@pytest.fixture(scope="class")
def control_under_test():
    loop = LoopThread()
    yield ControlUnderTest(LocalWorkerControl("worker-0", WorkerRefit(MemoryEngine(0)).controls()),
                           loop)
    loop.close()


class TestLocalWorkerControl(ControlContract):
    pass


@pytest.fixture(scope="class")
def metrics_under_test():
    loop = LoopThread()
    engine, gone = MemoryEngine(0), MemoryEngine(0)
    gone.die("stopped")

    def serve_rollout() -> int:
        served = loop.run(engine.serve_rollout([3, 4], request_id="metrics", max_new_tokens=5,
                                               sampling=GREEDY))
        return len(served.token_ids)

    yield MetricsUnderTest(EngineWorkerMetrics("worker-0", engine), loop, serve_rollout,
                           unreachable=EngineWorkerMetrics("worker-1", gone))
    loop.close()


class TestEngineWorkerMetrics(MetricsContract):
    pass
