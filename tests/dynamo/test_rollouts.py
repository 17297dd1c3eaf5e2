"""Rollouts and plain completions through the real Dynamo frontend, checked against the engine."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from tokenizers import Tokenizer

from rollout_fleet.adapters.memory.engine import VOCAB, MemoryEngine, decode
from rollout_fleet.core.rollout import FinishReason, RolloutRequest, SamplingSpec
from rollout_fleet.core.wire import completion_body, parse_completion_answer
from tests.dynamo.conftest import CONTEXT_LENGTH, ENGINE_SEED, SERVED_MODEL

pytestmark = pytest.mark.dynamo


def reference(request: RolloutRequest):
    """What the engine itself answers for the same spec (a fresh engine, same weights)."""
    engine = MemoryEngine(seed=ENGINE_SEED, context_length=CONTEXT_LENGTH)
    return asyncio.run(engine.serve_rollout(
        request.prompt_token_ids, request_id=request.request_id,
        max_new_tokens=request.max_new_tokens, sampling=request.sampling,
        stop_strings=request.stop_strings))


def through_fleet(fleet, request: RolloutRequest):
    answer = httpx.post(f"{fleet.url}/v1/completions", json=completion_body(request, SERVED_MODEL),
                        timeout=30)
    assert answer.status_code == 200, answer.text
    return parse_completion_answer(answer.content)


def assert_same(served, expected) -> None:
    assert served.token_ids == expected.token_ids
    assert served.logprobs == expected.logprobs  # exact: JSON round-trips floats losslessly
    assert served.finish_reason == expected.finish_reason


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stop_strings,budget", [((), 40), (("th",), 60), (("zzz", "an"), 5)])
def test_rollout_equals_engine(fleet, greedy, stop_strings, budget):
    request = RolloutRequest(request_id=f"eq-{greedy}-{budget}", prompt_token_ids=[3, 4, 5],
                             max_new_tokens=budget, stop_strings=stop_strings,
                             sampling=SamplingSpec(greedy=greedy, temperature=0.9, seed=11))
    served, expected = through_fleet(fleet, request), reference(request)
    assert_same(served, expected)
    assert len(served.token_ids) <= budget


def test_rollout_ending_in_eos_keeps_every_token(fleet):
    # Seed 10 after prompt [3] samples EOS (id 0) as its 13th token: the frontend must not
    # drop the chunk that carries the result.
    request = RolloutRequest(request_id="eos", prompt_token_ids=[3], max_new_tokens=60,
                             sampling=SamplingSpec(greedy=False, seed=10))
    expected = reference(request)
    assert expected.token_ids[-1] == 0 and expected.finish_reason is FinishReason.STOP
    assert_same(through_fleet(fleet, request), expected)


def test_two_hundred_mixed_rollouts_match(fleet):
    rng = random.Random(1234)
    requests = []
    for index in range(200):
        prompt = [rng.randrange(1, len(VOCAB)) for _ in range(rng.randint(1, 12))]
        stops = tuple(rng.sample(["th", "an", ".", "er", "zz"], rng.randint(0, 2)))
        sampling = SamplingSpec(greedy=rng.random() < 0.5, temperature=rng.choice([0.7, 1.0, 1.3]),
                                top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(10**6))
        requests.append(RolloutRequest(request_id=f"mix-{index}", prompt_token_ids=prompt,
                                       max_new_tokens=rng.randint(1, 64), stop_strings=stops,
                                       sampling=sampling))

    async def send_all():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=fleet.url, timeout=60, limits=limits) as client:
            gate = asyncio.Semaphore(32)

            async def one(request):
                async with gate:
                    answer = await client.post("/v1/completions",
                                               json=completion_body(request, SERVED_MODEL))
                assert answer.status_code == 200, answer.text
                return parse_completion_answer(answer.content)

            return await asyncio.gather(*(one(r) for r in requests))

    served = asyncio.run(send_all())
    mismatches = [r.request_id for r, s in zip(requests, served)
                  if (s.token_ids, s.logprobs, s.finish_reason) != _triple(reference(r))]
    assert mismatches == []
    finish_reasons = {s.finish_reason for s in served}
    assert finish_reasons == {FinishReason.STOP, FinishReason.LENGTH}  # both paths exercised


def _triple(served):
    return served.token_ids, served.logprobs, served.finish_reason


def test_plain_openai_completion(fleet):
    tokenizer = Tokenizer.from_file(str(fleet.model_path / "tokenizer.json"))
    prompt_ids = tokenizer.encode("the cat").ids
    expected = reference(RolloutRequest(request_id="plain", prompt_token_ids=prompt_ids,
                                        max_new_tokens=12))
    body = {"model": SERVED_MODEL, "prompt": "the cat", "max_tokens": 12, "temperature": 0}
    answer = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"] == decode(expected.token_ids)
    assert choice["finish_reason"] == expected.finish_reason.value
    assert answer.json()["usage"]["prompt_tokens"] == len(prompt_ids)

    streamed = []
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json={**body, "stream": True},
                      timeout=30) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += [c.get("text", "") for c in json.loads(line[6:])["choices"]]
    assert len(streamed) > 1  # token chunks, not one blob
    assert "".join(streamed) == choice["text"]


def test_plain_chat_completion(fleet):
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{fleet.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


def test_plain_completion_honours_stop_strings(fleet):
    # Seed 10 after prompt [3] produces "lginwofoth...": the engine stops at the token that
    # completes "th", and the frontend leaves the stop string out of the text (OpenAI's rule).
    sampling = SamplingSpec(greedy=False, temperature=1.0, seed=10)
    expected = decode(reference(RolloutRequest(request_id="stop", prompt_token_ids=[3],
                                               max_new_tokens=60, sampling=sampling,
                                               stop_strings=("th",))).token_ids)
    assert expected.endswith("th")
    body = {"model": SERVED_MODEL, "prompt": [3], "max_tokens": 60, "temperature": 1.0,
            "seed": 10, "stop": ["th"]}
    answer = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected[:-len("th")], "stop")
