"""A streamed chat turn through the door: the prefix-cache hit the worker reported reaches the
client in OpenAI's usage field, which comes in a chunk of its own after the worker's data."""

from __future__ import annotations

import json

from rollout_fleet.adapters.agent_door.answers import TurnStream


def event(chunk: dict) -> bytes:
    return f"data: {json.dumps(chunk)}\n".encode()


def test_the_usage_chunk_after_the_workers_data_carries_the_cached_prompt_tokens():
    relay = TurnStream([5, 6, 7, 8], {}, wants_ids=False, wants_logprobs=False)
    last = {"choices": [{"index": 0, "delta": {"content": " b"}, "finish_reason": "length"}],
            "nvext": {"engine_data": {"token_ids": [9, 10], "log_probs": [-0.5, -0.25],
                                      "cached_prompt_tokens": 3}}}
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    relayed = [json.loads(relay.line(event(chunk))[5:]) for chunk in (last, usage)]
    assert "nvext" not in relayed[0]
    assert relayed[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert relay.tokens is not None and relay.tokens.generation_token_ids == (9, 10)
    assert relay.line(b"data: [DONE]\n") == b"data: [DONE]\n"
