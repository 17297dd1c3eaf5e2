"""The adapter's own rules, called directly (Dynamo's Context and errors are real; the engines
are real classes implementing the engine port)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from dynamo._core import Context
from dynamo.common.backend.publisher import ZmqSource
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument

from rollout_fleet.adapters.dynamo import DynamoEngineAdapter
from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import encode_rollout_annotation
from rollout_fleet.ports.engine import EngineFacts, EnginePort, KvEventSource

pytestmark = pytest.mark.dynamo


class BrokenEngine(EnginePort):
    """Starts, publishes KV events, and raises on every rollout (an engine bug)."""

    async def start(self, worker_id):
        return EngineFacts(context_length=64, kv_block_size=8, total_kv_blocks=32, max_num_seqs=4)

    async def serve_rollout(self, prompt_token_ids: Sequence[int], **_kwargs):
        raise RuntimeError("kernel exploded")

    async def abort(self, request_id: str) -> None:
        pass

    def kv_event_sources(self):
        return (KvEventSource(kind="zmq", endpoint="tcp://127.0.0.1:5557", topic="kv"),)


def collect(adapter, request, context_id="ctx-1"):
    async def run():
        return [chunk async for chunk in adapter.generate(request, Context(id=context_id))]
    return asyncio.run(run())


def rollout_request(request_id="r-1", max_new_tokens=6) -> dict:
    spec = RolloutRequest(request_id=request_id, prompt_token_ids=[3, 4],
                          max_new_tokens=max_new_tokens)
    return {"token_ids": [3, 4], "annotations": [encode_rollout_annotation(spec)],
            "stop_conditions": {"max_tokens": max_new_tokens, "stop_token_ids_hidden": [0]}}


def test_engine_exception_becomes_a_clear_dynamo_error():
    adapter = DynamoEngineAdapter(BrokenEngine(), model_path="/m")
    with pytest.raises(InvalidArgument, match="engine failed: RuntimeError: kernel exploded"):
        collect(adapter, rollout_request())
    assert asyncio.run(adapter.engine_control("stats", {}))["failed"] == 1
    assert asyncio.run(adapter.engine_control("stats", {}))["in_flight"] == 0


def test_rollout_is_one_chunk_carrying_the_whole_result():
    chunks = collect(DynamoEngineAdapter(MemoryEngine(seed=0), model_path="/m"), rollout_request())
    assert len(chunks) == 1
    data = chunks[0]["engine_data"]
    assert len(data["token_ids"]) == len(data["logprobs"]) == 6
    assert chunks[0]["finish_reason"] == data["finish_reason"] == "length"
    assert chunks[0]["completion_usage"]["completion_tokens"] == 6


def test_start_registers_the_engine_facts_and_kv_sources_pass_through():
    adapter = DynamoEngineAdapter(BrokenEngine(), model_path="/models/x", served_model_name="x")
    config = asyncio.run(adapter.start(7))
    assert (config.model, config.served_model_name) == ("/models/x", "x")
    llm = config.llm
    assert (llm.context_length, llm.kv_cache_block_size, llm.total_kv_blocks, llm.max_num_seqs) \
        == (64, 8, 32, 4)
    sources = asyncio.run(adapter.kv_event_sources())
    assert sources == [ZmqSource(endpoint="tcp://127.0.0.1:5557", topic="kv")]


def test_abort_maps_dynamo_context_to_the_rollout_id():
    engine = MemoryEngine(seed=0, token_delay_s=0.01)
    adapter = DynamoEngineAdapter(engine, model_path="/m")

    async def run():
        context = Context(id="dynamo-ctx-9")
        serving = asyncio.ensure_future(
            _drain(adapter.generate(rollout_request("trainer-id-9", 100), context)))
        await asyncio.sleep(0.1)
        await adapter.abort(context)
        await adapter.abort(Context(id="never-seen"))  # unknown context: nothing to abort
        return await serving

    chunks = asyncio.run(run())
    assert engine.aborted_ids == ["trainer-id-9"]
    assert chunks[0]["engine_data"]["finish_reason"] == "abort"


async def _drain(generator):
    return [chunk async for chunk in generator]


def test_controls_table_secret_and_errors():
    calls = []

    async def refit(body):
        calls.append(body)
        if body.get("fail"):
            raise ValueError("bad refit info")
        return {"done": True}

    engine = MemoryEngine(seed=0)
    adapter = DynamoEngineAdapter(engine, control_secret="s3", controls={"update_weights": refit})
    assert adapter.supported_controls() == {"stats", "flush_cache", "weight_version",
                                            "update_weights"}
    control = lambda name, body: asyncio.run(adapter.engine_control(name, body))  # noqa: E731
    assert control("update_weights", {"control_secret": "s3", "x": 1}) == {"status": "ok", "done": True}
    assert calls == [{"x": 1}]  # the secret is not handed on
    refused = control("update_weights", {"control_secret": "s4", "x": 2})
    assert refused["status"] == "error" and "control_secret" in refused["message"]
    assert calls == [{"x": 1}]
    failed = control("update_weights", {"control_secret": "s3", "fail": True})
    assert failed == {"status": "error",
                      "message": "control 'update_weights' failed: ValueError: bad refit info"}
    unknown = control("nope", {"control_secret": "s3"})
    assert unknown["status"] == "error" and "unknown control 'nope'" in unknown["message"]
    assert control("weight_version", {"control_secret": "s3"}) == {"status": "ok", "weight_version": 0}
    with pytest.raises(InvalidValue, match="collides with a built-in"):
        DynamoEngineAdapter(engine, controls={"stats": refit})


def test_cleanup_twice_is_safe_and_stops_taking_requests():
    engine = MemoryEngine(seed=0)
    adapter = DynamoEngineAdapter(engine, model_path="/m")
    asyncio.run(adapter.cleanup())
    asyncio.run(adapter.cleanup())
    with pytest.raises(EngineShutdown):
        collect(adapter, rollout_request())
    assert engine.served_count == 0
