"""An endpoint served inside this (host) process: the host's logging is kept, and a client that
goes away mid-request reaches the engine's abort with that request's id."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import subprocess
import sys
import time

import attrs
import httpx
import pytest

from rollout_fleet.adapters.dynamo import DynamoEngineAdapter, dynamo_env, start_dynamo_endpoint
from rollout_fleet.adapters.http import HttpCompletionsTransport, HttpSettings
from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.core.errors import HttpStatusError, RetriesExhausted
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.rollout_client import RolloutClient
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import completion_body, parse_completion_answer
from rollout_fleet.core.loop_thread import LoopThread
from tests.dynamo.conftest import CONTEXT_LENGTH, ENGINE_SEED
from tests.support import free_port

pytestmark = pytest.mark.dynamo

SERVED = "mem-in-process"
FAULT_TOKEN = 46  # a prompt starting with it makes the engine fail (no other test uses it)


class FaultyEngine(MemoryEngine):
    """The memory engine, failing every rollout whose prompt starts with FAULT_TOKEN (an engine
    bug, as the worker sees one); counts each call it failed, by request id."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed_calls: dict[str, int] = {}

    async def serve_rollout(self, prompt_token_ids, **kwargs):
        if prompt_token_ids[0] == FAULT_TOKEN:
            request_id = kwargs["request_id"]
            self.failed_calls[request_id] = self.failed_calls.get(request_id, 0) + 1
            raise RuntimeError("kernel exploded")
        return await super().serve_rollout(prompt_token_ids, **kwargs)


@attrs.frozen
class InProcess:
    engine: MemoryEngine
    adapter: DynamoEngineAdapter
    handlers_before: list
    level_before: int
    handlers_after_start: list
    level_after_start: int


def wait_until(check, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    return check()


@pytest.fixture(scope="module")
def in_process(fleet):
    env_before = dict(os.environ)
    root = logging.getLogger()
    host_handler = logging.StreamHandler(io.StringIO())  # the host's own logging
    root.addHandler(host_handler)
    handlers_before, level_before = list(root.handlers), root.level
    loop = LoopThread()
    engine = FaultyEngine(seed=ENGINE_SEED, context_length=CONTEXT_LENGTH, token_delay_s=0.01)
    adapter = DynamoEngineAdapter(engine)

    async def start():
        return start_dynamo_endpoint(
            adapter, model_path=str(fleet.model_path), served_model_name=SERVED,
            namespace="test-in-process",
            engine_env=dynamo_env(fleet.run_dir, system_port=free_port()))

    task = loop.run(start())
    try:
        fleet.frontend.wait_for_model(SERVED, timeout_s=60)
        yield InProcess(engine, adapter, handlers_before, level_before,
                        list(root.handlers), root.level)
    finally:
        # Only a signal stops Dynamo's worker (cancelling does not): it serves on in this
        # process until pytest exits; the session's frontend goes first.
        loop.loop.call_soon_threadsafe(task.cancel)
        wait_until(task.done, 5)
        loop.close()
        os.environ.clear()
        os.environ.update(env_before)
        root.removeHandler(host_handler)


def test_host_root_logging_is_kept(in_process):
    assert in_process.handlers_after_start == in_process.handlers_before
    assert in_process.level_after_start == in_process.level_before
    # Still so after serving (pytest swaps its own capture handlers between phases, so check
    # for the host's handler and for the absence of Dynamo's bridge handler).
    from dynamo.runtime.logging import LogHandler as DynamoLogHandler

    handlers = logging.getLogger().handlers
    assert in_process.handlers_before[-1] in handlers
    assert not any(isinstance(h, DynamoLogHandler) for h in handlers)


def test_dynamo_logging_would_replace_the_host_handlers():
    # Why the guard exists: Dynamo's own configure_dynamo_logging swaps the root handlers.
    probe = ("import logging, io; h = logging.StreamHandler(io.StringIO()); "
             "logging.getLogger().addHandler(h); "
             "from dynamo.runtime.logging import configure_dynamo_logging; "
             "configure_dynamo_logging(); print(h in logging.getLogger().handlers)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "DYN_LOG": "error"})
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_rollout_served_in_process(fleet, in_process):
    request = RolloutRequest(request_id="in-process-ok", prompt_token_ids=[5, 6], max_new_tokens=5)
    answer = httpx.post(f"{fleet.url}/v1/completions", json=completion_body(request, SERVED),
                        timeout=30)
    assert answer.status_code == 200, answer.text
    expected = asyncio.run(MemoryEngine(seed=ENGINE_SEED).serve_rollout(
        [5, 6], request_id="x", max_new_tokens=5, sampling=request.sampling))
    assert parse_completion_answer(answer.content).token_ids == expected.token_ids


def test_client_gone_mid_rollout_aborts_that_request(fleet, in_process):
    request = RolloutRequest(request_id="abort-me-7", prompt_token_ids=[3], max_new_tokens=200)
    with pytest.raises(httpx.ReadTimeout):  # ~2 s of generation; the client leaves after 0.3 s
        httpx.post(f"{fleet.url}/v1/completions", json=completion_body(request, SERVED),
                   timeout=httpx.Timeout(30, read=0.3))
    assert wait_until(lambda: "abort-me-7" in in_process.engine.aborted_ids), \
        f"engine.abort never got the id; it got {in_process.engine.aborted_ids}"
    assert wait_until(lambda: not in_process.engine.in_flight)  # it stopped generating


def test_client_gone_mid_plain_completion_aborts_it(fleet, in_process):
    before = list(in_process.engine.aborted_ids)
    with httpx.stream("POST", f"{fleet.url}/v1/completions", timeout=30,
                      json={"model": SERVED, "prompt": [3], "max_tokens": 200, "stream": True,
                            "temperature": 0}) as answer:  # greedy from [3]: no early EOS
        first = next(line for line in answer.iter_lines() if line.startswith("data: "))
    # The client left after the first chunk, ~2 s before the generation would end.
    assert '"text"' in first
    new = wait_until(lambda: [i for i in in_process.engine.aborted_ids if i not in before])
    assert len(new) == 1 and new[0] != "abort-me-7"  # Dynamo's own id for a plain request
    assert wait_until(lambda: not in_process.engine.in_flight)


def test_an_engine_failure_is_a_500_that_the_driver_retries(fleet, in_process):
    plain = httpx.post(f"{fleet.url}/v1/completions", timeout=30,
                       json={"model": SERVED, "prompt": [FAULT_TOKEN, 3], "max_tokens": 3})
    assert plain.status_code == 500, plain.text
    transport = HttpCompletionsTransport(fleet.url, HttpSettings(max_in_flight=2))
    client = RolloutClient(transport, model=SERVED,
                           retry=RetryPolicy(max_attempts=3, base_delay_s=0.0, jitter=0.0))
    request = RolloutRequest(request_id="fails-3-times", prompt_token_ids=[FAULT_TOKEN, 3],
                             max_new_tokens=3)

    async def send():
        try:
            return await client.rollout(request)
        finally:
            await transport.aclose()

    with pytest.raises(RetriesExhausted) as caught:
        asyncio.run(send())
    assert caught.value.attempts == 3
    assert isinstance(caught.value.last_error, HttpStatusError) and caught.value.last_error.status == 500
    assert in_process.engine.failed_calls["fails-3-times"] == 3  # every attempt reached the engine


def test_a_request_the_engine_rejects_is_a_400_sent_once(fleet, in_process):
    transport = HttpCompletionsTransport(fleet.url, HttpSettings(max_in_flight=2))
    client = RolloutClient(transport, model=SERVED, retry=RetryPolicy(max_attempts=3))
    # A budget past the engine's context (256): the engine rejects the request as asked.
    request = RolloutRequest(request_id="rejected-once", prompt_token_ids=[3, 4],
                             max_new_tokens=CONTEXT_LENGTH * 4)
    served_before = in_process.engine.served_count

    async def send():
        try:
            return await client.rollout(request)
        finally:
            await transport.aclose()

    with pytest.raises(HttpStatusError) as caught:  # not retried: the first error as it came
        asyncio.run(send())
    assert caught.value.status == 400 and b"EngineRejected" in caught.value.body
    assert b"context_length=256" in caught.value.body
    assert in_process.engine.served_count == served_before  # refused before generating, once
