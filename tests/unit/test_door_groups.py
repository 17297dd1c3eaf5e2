"""The agent door's groups (n > 1): what a group request becomes, and what it refuses by
name; the choices it writes from served samples."""

from __future__ import annotations

import pytest

from rollout_fleet.adapters.agent_door.groups import (
    chat_answer, completion_answer, group_request, group_size, stream_events,
)
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import ServedRollout, Usage


def test_a_group_request_carries_n_the_budget_and_the_sampling():
    request = group_request({"n": 8, "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                             "seed": 3}, [4, 5, 6], default_max_tokens=None, chat=True)
    assert (request.n, request.max_new_tokens, request.prompt_token_ids) == (8, 5, (4, 5, 6))
    assert not request.sampling.greedy and request.sampling.seed == 3
    assert request.sampling.temperature == 0.7 and request.sampling.top_p == 0.9
    greedy = group_request({"n": 2, "temperature": 0}, [4], default_max_tokens=16, chat=False)
    assert greedy.sampling.greedy and greedy.max_new_tokens == 16


@pytest.mark.parametrize(("body", "field"), [
    ({"n": 2, "max_tokens": 4, "stop": ["x"]}, "stop"),
    ({"n": 2, "max_tokens": 4, "tools": []}, "tools"),
    ({"n": 2, "max_tokens": 4, "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"n": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos"),
    ({"n": 2}, "max_tokens"),  # a chat group: no default budget
    ({"n": 2, "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"n": 2000, "max_tokens": 4}, "n"),
])
def test_what_a_group_cannot_serve_is_refused_by_name(body, field):
    with pytest.raises(InvalidValue) as refused:
        group_request(body, [4], default_max_tokens=None, chat=True)
    assert refused.value.field == field


def test_what_vllms_benchmark_client_sends_with_n_is_served():
    body = {"model": "m", "prompt": "x", "n": 8, "max_tokens": 4, "repetition_penalty": 1.0,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    request = group_request(body, [4], default_max_tokens=None, chat=False)
    assert request.n == 8 and request.ignore_eos
    # It asks for no logprobs: the samples are drawn without them, as vLLM's server would.
    assert not request.logprobs


@pytest.mark.parametrize(("body", "chat", "asked"), [
    ({"n": 2, "max_tokens": 4}, False, False),
    ({"n": 2, "max_tokens": 4, "logprobs": 0}, False, True),
    ({"n": 2, "max_tokens": 4, "logprobs": 2}, False, True),
    # A chat's samples always carry them: its message's generation_log_probs.
    ({"n": 2, "max_tokens": 4}, True, True),
    ({"n": 2, "max_tokens": 4, "logprobs": False}, True, True),
])
def test_a_group_asks_for_logprobs_only_where_its_answer_carries_them(body, chat, asked):
    assert group_request(body, [4], default_max_tokens=None, chat=chat).logprobs is asked


def test_a_completion_group_without_logprobs_is_answered_without_them():
    samples = [ServedRollout([7, 8], None, "length", Usage(3, 2), weight_version=1)] * 2
    answer = completion_answer({"n": 2, "max_tokens": 2, "return_token_ids": True}, [4], samples,
                               lambda ids: "x" * len(ids), lambda ids: ["x"] * len(ids))
    assert [c["logprobs"] for c in answer["choices"]] == [None, None]
    assert [c["token_ids"] for c in answer["choices"]] == [[7, 8], [7, 8]]


def test_n_must_be_a_positive_int():
    assert group_size({}) == 1 and group_size({"n": None}) == 1 and group_size({"n": 3}) == 3
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(InvalidValue, match="n="):
            group_size({"n": bad})


def _served(tokens, reason="length", version=2):
    return ServedRollout(tokens, [-0.5] * len(tokens), reason, Usage(3, len(tokens)),
                         weight_version=version)


def test_the_answers_have_one_choice_per_sample_in_order():
    samples = [_served([7, 8]), _served([9], "stop")]
    decode = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    strings = lambda ids: [f"w{i}" for i in ids]  # noqa: E731
    text = completion_answer({"model": "m", "logprobs": 1, "return_token_ids": True}, [1, 2, 3],
                             samples, decode, strings)
    assert [c["text"] for c in text["choices"]] == ["w7 w8", "w9"]
    assert [c["finish_reason"] for c in text["choices"]] == ["length", "stop"]
    assert text["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.5]
    assert text["choices"][1]["token_ids"] == [9]
    assert text["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    chat = chat_answer({"model": "m"}, [1, 2, 3], samples, decode, strings)
    message = chat["choices"][1]["message"]
    assert message["generation_token_ids"] == [9] and message["prompt_token_ids"] == [1, 2, 3]
    assert message["weight_version"] == 2 and chat["choices"][1]["logprobs"] is None


def test_a_streamed_group_is_one_event_per_choice_then_the_usage_then_done():
    import json

    samples = [_served([7, 8]), _served([9], "stop")]
    decode = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    for write, kind in ((completion_answer, "text_completion"),
                        (chat_answer, "chat.completion.chunk")):
        answer = write(body, [1, 2, 3], samples, decode, lambda ids: [])
        text = stream_events(answer, body).decode()
        assert text.endswith("data: [DONE]\n\n")
        events = [json.loads(e[len("data: "):]) for e in text.split("\n\n")[:-2]]
        assert [e["object"] for e in events] == [kind] * 3
        assert [[c["index"] for c in e["choices"]] for e in events] == [[0], [1], []]
        assert events[-1]["usage"] == answer["usage"]
        if kind == "chat.completion.chunk":
            assert events[1]["choices"][0]["delta"]["generation_token_ids"] == [9]
        else:
            assert events[0]["choices"][0]["text"] == "w7 w8"
    unasked = stream_events(completion_answer({"model": "m"}, [1], samples, decode,
                                              lambda ids: []), {"model": "m"})
    assert unasked.decode().count("data: ") == 3  # two choices and [DONE]: no usage
