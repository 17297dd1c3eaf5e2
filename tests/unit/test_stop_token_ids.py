"""stop_token_ids on the rollout path: in the request, through the annotation, to the engine."""

import asyncio

import pytest

from rollout_fleet.adapters.memory.engine import MemoryEngine
from rollout_fleet.core.errors import AnnotationError, InvalidValue
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import decode_rollout_annotation, encode_rollout_annotation
from rollout_fleet.core.worker_service import serve_annotated_rollout


def test_the_annotation_carries_stop_token_ids_only_when_asked():
    plain = RolloutRequest("r1", [3, 4], 8)
    assert "stop_token_ids" not in encode_rollout_annotation(plain)
    assert decode_rollout_annotation(encode_rollout_annotation(plain)).stop_token_ids == ()
    asked = RolloutRequest("r2", [3, 4], 8, stop_token_ids=[7, 9])
    spec = decode_rollout_annotation(encode_rollout_annotation(asked))
    assert spec.stop_token_ids == (7, 9)
    assert spec.to_request([3, 4]) == asked


def test_bad_stop_token_ids_are_refused_by_name():
    with pytest.raises(InvalidValue, match=r"stop_token_ids\[1\]=-2"):
        RolloutRequest("r3", [3], 4, stop_token_ids=[1, -2])
    bad = encode_rollout_annotation(RolloutRequest("r4", [3], 4)).replace(
        '"stop_strings":[]', '"stop_strings":[],"stop_token_ids":["x"]')
    with pytest.raises(AnnotationError, match="stop_token_ids"):
        decode_rollout_annotation(bad)


def test_the_worker_side_stops_at_the_token_and_keeps_it():
    engine = MemoryEngine(seed=0)
    free = asyncio.run(serve_annotated_rollout(
        engine, [3, 4, 5], encode_rollout_annotation(RolloutRequest("free", [3, 4, 5], 10))))
    stop_at = free["token_ids"][2]
    stopped = asyncio.run(serve_annotated_rollout(engine, [3, 4, 5], encode_rollout_annotation(
        RolloutRequest("stop", [3, 4, 5], 10, stop_token_ids=[stop_at]))))
    end = free["token_ids"].index(stop_at) + 1
    assert stopped["token_ids"] == free["token_ids"][:end]
    assert stopped["finish_reason"] == "stop"
