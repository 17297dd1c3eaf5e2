"""The http adapter's worker control and metrics, against a real worker behind Dynamo's
system port, pass the worker-control and metrics contracts (the suites the in-memory fakes
pass)."""

import httpx
import pytest

from rollout_fleet.adapters.http import HttpWorkerControl, HttpWorkerMetrics
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import completion_body, parse_completion_answer
from rollout_fleet.ports.contracts.metrics import MetricsContract, MetricsUnderTest
from tests.dynamo.conftest import SERVED_MODEL
from tests.support import free_port
from rollout_fleet.ports.contracts.control import ControlUnderTest, SecretControlContract
from rollout_fleet.core.loop_thread import LoopThread
from tests.dynamo.conftest import CONTROL_SECRET

pytestmark = pytest.mark.dynamo


@pytest.fixture(scope="class")
def control_under_test(fleet):
    loop = LoopThread()
    control = HttpWorkerControl("worker-0", fleet.system_url, secret=CONTROL_SECRET)
    intruder = HttpWorkerControl("worker-0", fleet.system_url, secret="not-the-secret")
    yield ControlUnderTest(control, loop, intruder=intruder)
    loop.close()


class TestHttpWorkerControl(SecretControlContract):
    pass


@pytest.fixture(scope="class")
def metrics_under_test(fleet):
    loop = LoopThread()

    def serve_rollout() -> int:
        body = completion_body(RolloutRequest("metrics-contract", [3, 4, 5], 6), SERVED_MODEL)
        answer = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        return len(parse_completion_answer(answer.content).token_ids)

    yield MetricsUnderTest(HttpWorkerMetrics("worker-0", fleet.system_url), loop, serve_rollout,
                           unreachable=HttpWorkerMetrics("gone", f"http://127.0.0.1:{free_port()}"))
    loop.close()


class TestHttpWorkerMetrics(MetricsContract):
    pass
