"""Groups on the rollout door: n samples of one prompt in one request, each with its own seed,
logprobs and weight versions; bad sizes refused by name, on the driver and on the worker."""

import asyncio

import pytest

from rollout_fleet.adapters.memory import EngineCompletionsTransport, MemoryEngine
from rollout_fleet.core.errors import AnnotationError, InvalidValue, WireError
from rollout_fleet.core.rollout import (
    GREEDY, MAX_GROUP_SIZE, RolloutRequest, SamplingSpec, sample_sampling,
)
from rollout_fleet.core.rollout_client import RolloutClient
from rollout_fleet.core.wire import (
    decode_rollout_annotation, encode_rollout_annotation, group_engine_data_of, parse_group_answer,
)

SEEDED = SamplingSpec(greedy=False, temperature=1.0, seed=40)


def _request(n, sampling=SEEDED, request_id="g"):
    return RolloutRequest(request_id, [3, 4, 5], 8, sampling=sampling, n=n)


@pytest.mark.parametrize("n", [0, -1, MAX_GROUP_SIZE + 1, True, 2.0])
def test_a_bad_group_size_is_refused_naming_n_and_its_value(n):
    with pytest.raises(InvalidValue) as refused:
        _request(n)
    assert refused.value.field == "n" and refused.value.value == n


def test_a_seed_that_would_run_past_2_63_in_the_group_is_refused():
    with pytest.raises(InvalidValue, match="seed"):
        _request(4, SamplingSpec(greedy=False, seed=2**63 - 2))
    assert _request(4, SamplingSpec(greedy=False, seed=2**63 - 4)).n == 4


def test_the_annotation_carries_n_only_for_a_group_and_a_worker_refuses_a_bad_one():
    assert '"n"' not in encode_rollout_annotation(_request(1))
    assert decode_rollout_annotation(encode_rollout_annotation(_request(5))).n == 5
    bad = encode_rollout_annotation(_request(2)).replace('"n":2', '"n":0')
    with pytest.raises(AnnotationError, match="n"):
        decode_rollout_annotation(bad)


def test_an_answer_with_a_sample_missing_is_a_wire_error():
    body = b'{"nvext": {"engine_data": %s}}' % str(group_engine_data_of([])).encode()
    with pytest.raises(WireError, match="group of 2 samples was answered with 0"):
        parse_group_answer(body.replace(b"'", b'"'), 2)


def test_a_group_through_the_client_is_its_samples_each_seeded_alone():
    engine = MemoryEngine(seed=0)
    transport = EngineCompletionsTransport(engine)
    client = RolloutClient(transport, model="memory")

    async def run():
        group = await client.rollout_group(_request(4))
        alone = [await client.rollout(RolloutRequest(f"a{i}", [3, 4, 5], 8,
                                                     sampling=sample_sampling(SEEDED, i)))
                 for i in range(4)]
        greedy = await client.rollout_group(_request(3, GREEDY, "h"))
        return group, alone, greedy

    group, alone, greedy = asyncio.run(run())
    assert [r.request_id for r in group] == ["g/0", "g/1", "g/2", "g/3"]
    assert [r.token_ids for r in group] == [r.token_ids for r in alone]
    assert [r.logprobs for r in group] == [r.logprobs for r in alone]
    assert len({r.token_ids for r in group}) > 1
    assert len({r.token_ids for r in greedy}) == 1 and len(greedy) == 3
    assert transport.seen_request_ids[0] == "g"  # one request for the group


def test_a_group_the_worker_refuses_is_answered_400_naming_n_and_its_value():
    transport = EngineCompletionsTransport(MemoryEngine(seed=0))
    annotation = encode_rollout_annotation(_request(2)).replace('"n":2', f'"n":{MAX_GROUP_SIZE + 1}')
    body = {"model": "memory", "prompt": [3], "nvext": {"annotations": [annotation]}}
    answer = asyncio.run(transport.post_completion(body, request_id="g"))
    assert answer.status == 400
    assert f"n={MAX_GROUP_SIZE + 1}" in answer.body.decode()
