"""The worker-control client and the metrics sampler against a real loopback server."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rollout_fleet.adapters.http import (
    HttpSettings, HttpWorkerControl, HttpWorkerMetrics, LoopClients, parse_prometheus_text,
)
from rollout_fleet.core.errors import ControlRefused, InvalidValue, TransportError
from tests.http.loopback_frontend import SECRET, LoopbackFrontend


@pytest.fixture(scope="module")
def server():
    s = LoopbackFrontend()
    yield s
    s.close()


def call(control, name, body=None, **kw):
    async def go():
        try:
            return await control.call(name, body or {}, **kw)
        finally:
            await control.clients.aclose()
    return asyncio.run(go())


def test_an_ok_answer_is_returned_and_the_secret_travels_in_the_body(server):
    control = HttpWorkerControl("w0", server.url, secret=SECRET)
    before = server.flushes
    answer = call(control, "flush_cache", {"reason": "test"})
    assert answer == {"status": "ok", "flushed": True}
    assert server.flushes == before + 1
    assert server.control_bodies[-1] == ("flush_cache", {"reason": "test", "control_secret": SECRET})


def test_status_error_with_http_200_is_a_refusal(server):
    control = HttpWorkerControl("w0", server.url, secret=SECRET)
    with pytest.raises(ControlRefused, match="refused on purpose") as caught:
        call(control, "refuse_with_200")
    assert "'w0'" in str(caught.value) and "refuse_with_200" in str(caught.value)


def test_a_bad_secret_is_a_refusal(server):
    control = HttpWorkerControl("w1", server.url, secret="wrong")
    with pytest.raises(ControlRefused, match="bad control secret"):
        call(control, "flush_cache")


def test_a_401_is_a_refusal_whatever_its_body_says(server):
    control = HttpWorkerControl("w0", server.url, secret=SECRET)
    with pytest.raises(ControlRefused, match=r"refused \(HTTP 401\)"):
        call(control, "refuse_with_401_text")


def test_the_blocking_control_call_checks_the_status_too(server):
    from rollout_fleet.wiring.fleet import call_control

    assert call_control(server.url, "flush_cache", SECRET)["status"] == "ok"
    with pytest.raises(ValueError, match=r"HTTP 401.*bad control secret"):
        call_control(server.url, "flush_cache", "wrong")
    with pytest.raises(ValueError, match=r"HTTP 401.*unauthorized"):
        call_control(server.url, "refuse_with_401_text", SECRET)


def test_an_unknown_control_is_a_refusal(server):
    control = HttpWorkerControl("w0", server.url, secret=SECRET)
    with pytest.raises(ControlRefused, match="no such control"):
        call(control, "no_such_control")


def test_bad_names_and_bodies_are_refused_before_sending(server):
    control = HttpWorkerControl("w0", server.url, secret=SECRET)
    with pytest.raises(InvalidValue, match="control name"):
        call(control, "../metrics")
    with pytest.raises(InvalidValue, match="must be a JSON object"):
        asyncio.run(control.call("flush_cache", ["not", "a", "mapping"]))


def test_an_unreachable_worker_is_a_transport_error():
    control = HttpWorkerControl("gone", "http://127.0.0.1:9", secret=SECRET)
    with pytest.raises(TransportError, match="127.0.0.1:9"):
        call(control, "flush_cache")


def test_a_pickled_control_reaches_the_same_worker_and_hides_its_secret_in_repr(server):
    control = HttpWorkerControl("w0", server.url, secret=SECRET)
    copy = pickle.loads(pickle.dumps(control))
    assert SECRET not in repr(copy)
    assert call(copy, "weight_version") == {"status": "ok", "weight_version": 0}


def test_metrics_sample_reads_the_workers_prometheus_text(server):
    clients = LoopClients(HttpSettings())
    sampler = HttpWorkerMetrics("w0", server.url, clients=clients)

    async def go():
        try:
            return await sampler.sample()
        finally:
            await clients.aclose()
    load = asyncio.run(go())
    assert load.worker_id == "w0"
    assert load.inflight_requests == 0.0
    assert load.kv_cache_usage == pytest.approx(0.375)  # two ranks' series summed
    assert load.generated_tokens == float(server.engine.served_count * 3)


def test_prometheus_parsing_sums_series_and_skips_comments_and_junk():
    text = ('# HELP a x\n# TYPE a gauge\na{x="1",y="}"} 2\na 3 1700000000\nab 100\n'
            'b{le="+Inf"} NaN\nc{q="1"} 1e3\nd notanumber\n')
    assert parse_prometheus_text(text, ["a", "b", "c", "d", "missing"]) == {"a": 5.0, "c": 1000.0}
