"""The adapter's own rules, called directly (Dynamo's Context and errors are real; the engines
are real classes implementing the engine port)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from dynamo._core import Context
from dynamo.common.backend.publisher import ZmqSource
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown

from rollout_fleet.adapters.dynamo import DynamoEngineAdapter
from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import FinishReason, RolloutRequest, SamplingSpec
from rollout_fleet.core.wire import encode_rollout_annotation
from rollout_fleet.ports.engine import EngineFacts, EnginePort, KvEventSource, RolloutPiece

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


def test_engine_failure_is_a_server_error_the_driver_retries():
    # Unknown answers HTTP 500 (a 5xx: retried); InvalidArgument (400) is kept for bad requests.
    adapter = DynamoEngineAdapter(BrokenEngine(), model_path="/m")
    with pytest.raises(Unknown, match="engine failed: RuntimeError: kernel exploded"):
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
    assert adapter.supported_controls() == {"stats", "abort_rollout", "flush_cache", "weight_version",
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
    # The secret first: a stranger learns neither the controls nor what is wrong with the body.
    answer = lambda name, body: asyncio.run(adapter.controls.answer_control(name, body))  # noqa: E731
    for name in ("nope", "update_weights"):
        for body in ({"control_secret": "s4"}, {}, ["s3"], None):
            status, refusal = answer(name, body)
            assert status == 401 and refusal["message"].startswith("control refused: "), refusal
            assert "update_weights" not in refusal["message"] and "stats" not in refusal["message"]
    assert answer("update_weights", ["s3"])[0] == 401
    assert answer("nope", {"control_secret": "s3"})[0] == 404
    open_adapter = DynamoEngineAdapter(engine)  # no secret: the body is judged at once
    assert asyncio.run(open_adapter.controls.answer_control("stats", None))[0] == 400
    assert calls == [{"x": 1}, {"fail": True}]
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


def plain_request(**asks) -> dict:
    """A plain request as the frontend hands it to the worker (fields checked with 1.6.1)."""
    request = {"token_ids": [3, 4, 5], "eos_token_ids": [0],
               "stop_conditions": {"max_tokens": 8, "stop_token_ids_hidden": [0]},
               "sampling_options": {"temperature": 0.0}, "output_options": {}, "extra_args": {}}
    for section, values in asks.items():
        request[section] = {**request[section], **values}
    return request


def served_directly(engine, max_new_tokens=8, **keywords):
    return asyncio.run(engine.serve_rollout([3, 4, 5], request_id="direct",
                                            max_new_tokens=max_new_tokens,
                                            sampling=SamplingSpec(), **keywords))


def flat(chunks, key):
    return [item for chunk in chunks for item in chunk.get(key, [])]


def test_plain_chunks_carry_each_tokens_logprob_and_top_alternatives():
    engine = MemoryEngine(seed=0)
    chunks = collect(DynamoEngineAdapter(engine, model_path="/m"),
                     plain_request(output_options={"logprobs": 3}))
    direct = served_directly(engine, top_logprobs=3)
    shown = [t for t in direct.token_ids if t != 0]
    assert flat(chunks, "token_ids") == shown
    assert flat(chunks, "log_probs") == [lp for t, lp in zip(direct.token_ids, direct.logprobs) if t != 0]
    for alternatives, top in zip(flat(chunks, "top_logprobs"), direct.top_logprobs):
        assert [(a["token_id"], a["logprob"]) for a in alternatives] == list(top)
        assert [a["rank"] for a in alternatives] == [1, 2, 3]
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(alternatives, alternatives[1:]))
    assert chunks[-1]["finish_reason"] == direct.finish_reason.value


def test_plain_chunks_without_logprobs_asked_carry_none():
    chunks = collect(DynamoEngineAdapter(MemoryEngine(seed=0), model_path="/m"), plain_request())
    assert chunks and all("log_probs" not in c and "top_logprobs" not in c for c in chunks)


class LogprobsRecordingEngine(MemoryEngine):
    """Records whether each stream was asked for logprobs."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.asked: list[bool] = []

    async def stream_rollout(self, prompt_token_ids, *, with_logprobs=True, **keywords):
        self.asked.append(with_logprobs)
        async for piece in super().stream_rollout(prompt_token_ids, with_logprobs=with_logprobs,
                                                  **keywords):
            yield piece


def test_an_engine_is_asked_for_logprobs_only_when_the_client_asked():
    engine = LogprobsRecordingEngine()
    adapter = DynamoEngineAdapter(engine, model_path="/m")
    bare = collect(adapter, plain_request())
    with_chosen = collect(adapter, plain_request(output_options={"logprobs": 0}))
    assert engine.asked == [False, True]
    assert flat(bare, "token_ids") == flat(with_chosen, "token_ids")  # the same tokens either way


class NarrowStreamEngine(MemoryEngine):
    """An older backend: its stream_rollout names no with_logprobs (and takes nothing else)."""

    async def stream_rollout(self, prompt_token_ids, *, request_id, max_new_tokens, sampling,
                             stop_strings=()):
        served = await self.serve_rollout(prompt_token_ids, request_id=request_id,
                                          max_new_tokens=max_new_tokens, sampling=sampling)
        yield RolloutPiece.whole(served)


def test_an_engine_whose_stream_takes_no_with_logprobs_is_never_passed_it():
    engine = NarrowStreamEngine(seed=0)
    chunks = collect(DynamoEngineAdapter(engine, model_path="/m"), plain_request())
    assert flat(chunks, "token_ids") == [t for t in served_directly(engine).token_ids if t != 0]


def test_logprobs_zero_gives_the_chosen_tokens_logprob_only():
    chunks = collect(DynamoEngineAdapter(MemoryEngine(seed=0), model_path="/m"),
                     plain_request(output_options={"logprobs": 0}))
    assert all(len(c["log_probs"]) == len(c["token_ids"]) and c["top_logprobs"] == [[]] * len(c["token_ids"])
               for c in chunks if c["token_ids"])


def test_stop_token_ids_end_the_generation_at_that_token():
    engine = MemoryEngine(seed=0)
    free = served_directly(engine, max_new_tokens=8)
    stop_at = free.token_ids[2]
    chunks = collect(DynamoEngineAdapter(engine, model_path="/m"),
                     plain_request(stop_conditions={"stop_token_ids": [stop_at]}))
    tokens = flat(chunks, "token_ids")
    assert tokens == list(free.token_ids[:free.token_ids.index(stop_at) + 1])
    assert chunks[-1]["finish_reason"] == FinishReason.STOP.value


@pytest.mark.parametrize("section, asks, named", [
    ("sampling_options", {"n": 2}, "n=2"),
    ("sampling_options", {"best_of": 3}, "best_of=3"),
    ("sampling_options", {"presence_penalty": 0.5}, "presence_penalty=0.5"),
    ("sampling_options", {"repetition_penalty": 1.5}, "repetition_penalty=1.5"),
    ("sampling_options", {"min_p": 0.25}, "min_p=0.25"),
    ("sampling_options", {"repetition_penalty": -1.0}, "repetition_penalty=-1.0: must be"),
    ("sampling_options", {"use_beam_search": True}, "use_beam_search"),
    ("extra_args", {"sampling_options": {"bad_words_token_ids": [[3]]}}, "bad_words_token_ids"),
    ("stop_conditions", {"min_tokens": -4}, "min_tokens=-4"),
    ("output_options", {"prompt_logprobs": 1}, "echo / prompt_logprobs=1"),
    ("output_options", {"logprobs": -1}, "logprobs=-1"),
], ids=["n", "best_of", "penalty", "repetition", "min_p", "bad_penalty", "beam", "bad_words",
        "bad_min_tokens", "echo", "negative_logprobs"])
def test_an_option_the_engine_cannot_honour_is_refused_by_name(section, asks, named):
    engine = MemoryEngine(seed=0)
    adapter = DynamoEngineAdapter(engine, model_path="/m")
    with pytest.raises(InvalidArgument, match=f"request rejected: InvalidValue: {named}"):
        collect(adapter, plain_request(**{section: asks}))
    assert engine.served_count == 0
    assert asyncio.run(adapter.engine_control("stats", {}))["rejected"] == 1


def test_an_engine_without_top_logprobs_gets_such_requests_refused():
    adapter = DynamoEngineAdapter(BrokenEngine(), model_path="/m")
    with pytest.raises(InvalidArgument, match="logprobs > 0 .*does not offer it"):
        collect(adapter, plain_request(output_options={"logprobs": 2}))
    with pytest.raises(InvalidArgument, match="stop_token_ids=.*does not offer it"):
        collect(adapter, plain_request(stop_conditions={"stop_token_ids": [7]}))


def test_a_prompt_the_engine_rejects_is_a_bad_request_not_a_failure():
    engine = MemoryEngine(seed=0)
    adapter = DynamoEngineAdapter(engine, model_path="/m")
    request = plain_request()
    request["token_ids"] = [3, 999]  # outside the vocabulary
    with pytest.raises(InvalidArgument, match="request rejected: EngineRejected: .*vocabulary"):
        collect(adapter, request)
    stats = asyncio.run(adapter.engine_control("stats", {}))
    assert (stats["rejected"], stats["failed"]) == (1, 0)


def test_a_rollout_asking_stop_token_ids_of_an_engine_without_them_is_a_400():
    spec = RolloutRequest(request_id="r-stop", prompt_token_ids=[3, 4], max_new_tokens=4,
                          stop_token_ids=[7])
    request = {"token_ids": [3, 4], "annotations": [encode_rollout_annotation(spec)],
               "stop_conditions": {"max_tokens": 4, "stop_token_ids_hidden": [0]}}
    with pytest.raises(InvalidArgument, match="stop_token_ids=\\[7\\]: .*does not offer it"):
        collect(DynamoEngineAdapter(BrokenEngine(), model_path="/m"), request)


class EngineOfferingNothing(MemoryEngine):
    def sampling_offered(self):
        return frozenset()


def test_a_rollout_ignoring_eos_on_an_engine_that_does_not_offer_it_is_a_400():
    spec = RolloutRequest(request_id="r-eos", prompt_token_ids=[3, 4], max_new_tokens=4,
                          ignore_eos=True)
    request = {"token_ids": [3, 4], "annotations": [encode_rollout_annotation(spec)],
               "stop_conditions": {"max_tokens": 4, "stop_token_ids_hidden": [0]}}
    engine = EngineOfferingNothing(seed=0)
    with pytest.raises(InvalidArgument, match="ignore_eos=True: .*does not offer it"):
        collect(DynamoEngineAdapter(engine, model_path="/m"), request)
    assert engine.served_count == 0


# What vLLM's benchmark client and other OpenAI clients send unasked, as the frontend passes it.
NEUTRAL_ASKS = {"sampling_options": {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                                     "frequency_penalty": 0.0, "min_p": 0.0, "top_k": -1},
                "stop_conditions": {"min_tokens": 0, "ignore_eos": False}}


def test_neutral_sampling_values_are_served_by_an_engine_that_offers_none():
    engine = EngineOfferingNothing(seed=0)
    adapter = DynamoEngineAdapter(engine, model_path="/m")
    assert collect(adapter, plain_request(**NEUTRAL_ASKS)) == collect(adapter, plain_request())
    assert engine.served_count == 2


def test_offered_sampling_options_reach_the_engine():
    engine = MemoryEngine(seed=0)
    adapter = DynamoEngineAdapter(engine, model_path="/m")
    asks = {"stop_conditions": {"min_tokens": 6, "ignore_eos": True, "max_tokens": 12},
            "extra_args": {"sampling_options": {"allowed_token_ids": [4, 7, 9]}}}
    chunks = collect(adapter, plain_request(**asks))
    direct = served_directly(engine, max_new_tokens=12, extra_sampling={
        "min_tokens": 6, "ignore_eos": True, "allowed_token_ids": [4, 7, 9]})
    assert flat(chunks, "token_ids") == list(direct.token_ids)
    assert set(direct.token_ids) <= {4, 7, 9} and len(direct.token_ids) == 12


class SteppedEngine(MemoryEngine):
    """Streams one token, then waits for the test to let it finish."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.go_on = asyncio.Event()
        self.closed_early = False

    async def stream_rollout(self, prompt_token_ids, **_keywords):
        from rollout_fleet.ports.engine import RolloutPiece

        finished = False
        try:
            yield RolloutPiece((7,), (-0.5,))
            await self.go_on.wait()
            yield RolloutPiece((8,), (-0.25,), FinishReason.LENGTH)
            finished = True
        finally:
            self.closed_early = not finished


def test_a_plain_requests_first_chunk_leaves_before_the_generation_ends():
    engine = SteppedEngine()
    adapter = DynamoEngineAdapter(engine, model_path="/m")

    async def run():
        chunks = adapter.generate(plain_request(), Context(id="stepped"))
        first = await chunks.__anext__()
        assert not engine.go_on.is_set()  # the engine has not finished
        engine.go_on.set()
        return first, [chunk async for chunk in chunks]

    first, rest = asyncio.run(run())
    assert first == {"token_ids": [7], "index": 0}
    assert [c["token_ids"] for c in rest] == [[8]]
    assert rest[-1]["finish_reason"] == "length"
    assert rest[-1]["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                            "total_tokens": 5}


def test_a_client_leaving_mid_stream_closes_the_engines_stream_at_once():
    engine = SteppedEngine()
    adapter = DynamoEngineAdapter(engine, model_path="/m")

    async def run():
        chunks = adapter.generate(plain_request(), Context(id="left"))
        await chunks.__anext__()
        await chunks.aclose()  # what Dynamo does when the client goes away
        return engine.closed_early  # now, not when the loop's shutdown closes what is left

    assert asyncio.run(run())
    assert asyncio.run(adapter.engine_control("stats", {}))["in_flight"] == 0
