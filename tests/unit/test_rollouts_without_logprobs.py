"""A rollout that asks for no logprobs (a trainer that recomputes them): in the request,
through the annotation, to the engine (which computes none where it can), and back as None."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import EngineCompletionsTransport, MemoryEngine
from rollout_fleet.core.errors import AnnotationError, InvalidValue, MissingField
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec, ServedRollout, Usage
from rollout_fleet.core.rollout_client import RolloutClient
from rollout_fleet.core.wire import (
    decode_rollout_annotation, encode_rollout_annotation, engine_data_of,
    served_from_engine_data,
)
from tests.support.annotated import serve_annotated as serve

SAMPLED = SamplingSpec(greedy=False, temperature=1.0, seed=5)


@pytest.mark.parametrize(("field", "unasked", "asked", "bad"), [
    ("logprobs", True, False, 0),
    ("ignore_eos", False, True, 1),
])
def test_an_optional_field_travels_in_the_annotation_only_when_asked(field, unasked, asked, bad):
    plain = RolloutRequest("r1", [3, 4], 8)
    assert getattr(plain, field) is unasked and field not in encode_rollout_annotation(plain)
    request = RolloutRequest("r2", [3, 4], 8, **{field: asked})
    assert decode_rollout_annotation(encode_rollout_annotation(request)).to_request([3, 4]) \
        == request
    with pytest.raises(InvalidValue, match=f"{field}={bad}"):
        RolloutRequest("r3", [3], 4, **{field: bad})
    garbled = encode_rollout_annotation(plain).replace(
        '"stop_strings":[]', f'"stop_strings":[],"{field}":"yes"')
    with pytest.raises(AnnotationError, match=field):
        decode_rollout_annotation(garbled)


@pytest.mark.parametrize("n", [1, 3])
def test_the_engine_answers_the_same_tokens_with_null_logprobs(n):
    engine = MemoryEngine(seed=0)
    asked = serve(engine, RolloutRequest("a", [5, 6, 7], 12, sampling=SAMPLED, n=n))
    bare = serve(engine, RolloutRequest("b", [5, 6, 7], 12, sampling=SAMPLED, n=n,
                                        logprobs=False))
    asked_samples, bare_samples = asked.get("samples", [asked]), bare.get("samples", [bare])
    assert [s["token_ids"] for s in bare_samples] == [s["token_ids"] for s in asked_samples]
    assert all(s["logprobs"] is None for s in bare_samples)
    assert all(len(s["logprobs"]) == len(s["token_ids"]) for s in asked_samples)


class LogprobsAnyway(MemoryEngine):
    """An engine without the ``with_logprobs`` keyword: it always computes them."""

    async def serve_rollout(self, prompt_token_ids, *, request_id, max_new_tokens, sampling,
                            stop_strings=()):
        return await super().serve_rollout(prompt_token_ids, request_id=request_id,
                                           max_new_tokens=max_new_tokens, sampling=sampling,
                                           stop_strings=stop_strings)


def test_a_worker_drops_the_logprobs_an_engine_computed_unasked():
    bare = serve(LogprobsAnyway(seed=0), RolloutRequest("b", [5, 6], 6, logprobs=False))
    assert bare["logprobs"] is None and len(bare["token_ids"]) >= 1


def test_null_logprobs_travel_as_none_and_a_list_still_needs_one_per_token():
    served = ServedRollout([4, 5], None, "length", Usage(2, 2))
    assert served_from_engine_data(engine_data_of(served)) == served
    with pytest.raises(InvalidValue, match="one logprob per generated token"):
        ServedRollout([4, 5], [-0.1], "length", Usage(2, 2))


class NeverLogprobs(MemoryEngine):
    """An engine that answers no logprobs even when asked (a defect the driver must catch)."""

    async def serve_rollout(self, prompt_token_ids, **keywords):
        return await super().serve_rollout(prompt_token_ids, **{**keywords,
                                                                "with_logprobs": False})


def client_of(engine) -> RolloutClient:
    return RolloutClient(EngineCompletionsTransport(engine), model="memory")


def test_the_client_gets_the_same_tokens_and_none_for_logprobs():
    client = client_of(MemoryEngine(seed=0))
    asked = asyncio.run(client.rollout(RolloutRequest("a", [1, 2], 9, sampling=SAMPLED)))
    bare = asyncio.run(client.rollout(RolloutRequest("b", [1, 2], 9, sampling=SAMPLED,
                                                     logprobs=False)))
    assert bare.token_ids == asked.token_ids and bare.logprobs is None
    assert len(asked.logprobs) == len(asked.token_ids)
    group = asyncio.run(client.rollout_group(RolloutRequest("g", [1, 2], 9, sampling=SAMPLED,
                                                            n=3, logprobs=False)))
    assert [r.logprobs for r in group] == [None] * 3
    empty = asyncio.run(client.rollout(RolloutRequest("e", [1, 2], 0, logprobs=False)))
    assert empty.logprobs is None and empty.token_ids == ()


def test_the_client_refuses_an_answer_without_the_logprobs_it_asked_for():
    client = client_of(NeverLogprobs(seed=0))
    with pytest.raises(MissingField, match="logprobs"):
        asyncio.run(client.rollout(RolloutRequest("r", [1, 2], 4)))
    with pytest.raises(MissingField, match="logprobs"):
        asyncio.run(client.rollout_group(RolloutRequest("g", [1, 2], 4, sampling=SAMPLED, n=2)))
