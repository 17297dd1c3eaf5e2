"""The door in front of a stand-in frontend (an aiohttp server on loopback that answers as
Dynamo's does and fails as told): the hop retries what the driver retries and nothing else,
within its connect and read deadlines; a pinned request the worker cannot serve goes to any
other; a rollout of the driver passes as its bytes are; every refusal comes with its status
before the first byte and names the field; and after each, the next request is served.
The real fleet's door is tested in tests/fleet/test_door.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from rollout_fleet.adapters.agent_door.hop import HopSettings
from rollout_fleet.adapters.agent_door.replies import DOOR_PROCESS_HEADER, PROMPT_HEADER
from rollout_fleet.adapters.tiny_model.build import BOS, EOS, PAD, TOOL_ALPHABET, TOOL_CHAT_TEMPLATE
from rollout_fleet.core.retry import RetryPolicy
from tests.support.served_app import Served, thread_door

MAX_MODEL_LEN = 128
GENERATED = [40, 41, 2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A model folder with the tiny model's tokenizer and chat template (no weights)."""
    from transformers import PreTrainedTokenizerFast

    from rollout_fleet.adapters.tiny_model.build import train_tokenizer

    folder = tmp_path_factory.mktemp("door-tokenizer")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(512, TOOL_ALPHABET),
                                        bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return folder


class Frontend:
    """Answers chat and completions as Dynamo's frontend does (the worker's data in
    ``nvext``), first failing with each status in ``failures``; keeps every body it got."""

    def __init__(self) -> None:
        self.failures: list[int] = []
        self.delay_s = 0.0
        self.received: list[bytes] = []
        self.unpinnable: set[int] = set()  # instances that answer 404 (gone)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.answer)
        app.router.add_post("/v1/completions", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append(raw)
        if self.failures:
            return web.json_response({"error": "failing as told"}, status=self.failures.pop(0))
        await asyncio.sleep(self.delay_s)
        body = json.loads(raw)
        if body.get("nvext", {}).get("backend_instance_id") in self.unpinnable:
            return web.json_response({"error": "no such instance"}, status=404)
        nvext = {"engine_data": {"token_ids": GENERATED, "log_probs": [-0.5] * 3,
                                 "weight_version": 0}, "worker_id": {"decode_worker_id": 7}}
        choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
                                                                  "content": "ok"}}
        answer = {"id": "x", "object": "chat.completion", "choices": [choice], "nvext": nvext,
                  "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}
        if not body.get("stream"):
            return web.json_response(answer)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(f"data: {json.dumps(answer)}\n\ndata: [DONE]\n\n".encode())
        return stream


@pytest.fixture(scope="module")
def frontend():
    stand_in = Frontend()
    served = Served(stand_in.app())
    stand_in.url = served.url
    yield stand_in
    served.stop()


def door_for(frontend_url: str, model: Path, **hop) -> Served:
    settings = HopSettings(retry=RetryPolicy(max_attempts=3, base_delay_s=0.01), **hop)
    return thread_door(frontend_url, model, "tiny", max_model_len=MAX_MODEL_LEN, hop=settings)


@pytest.fixture(scope="module")
def door(frontend, model):
    server = door_for(frontend.url, model, read_s=1.0)
    yield server.url
    server.stop()


@pytest.fixture(autouse=True)
def _fresh(frontend):
    frontend.failures, frontend.delay_s, frontend.received = [], 0.0, []


def chat(door: str, messages=None, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": messages or [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **fields}
    return httpx.post(f"{door}/v1/chat/completions", json=body, timeout=30)


def served(door: str) -> None:
    answer = chat(door)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["generation_token_ids"] == GENERATED


def test_what_the_driver_retries_is_sent_again_and_nothing_else(door, frontend):
    frontend.failures = [503, 429]
    served(door)
    assert len(frontend.received) == 3
    frontend.failures, frontend.received = [400], []
    answer = chat(door)
    assert answer.status_code == 400 and len(frontend.received) == 1  # the frontend's own
    frontend.failures, frontend.received = [502, 502, 502], []
    assert chat(door).status_code == 502 and len(frontend.received) == 3  # attempts spent
    served(door)


def test_a_group_is_retried_whole(door, frontend):
    frontend.failures = [500]
    answer = httpx.post(f"{door}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": [5, 6], "n": 2, "max_tokens": 3})
    # The stand-in answers no group, so the door says so; but the group was sent again.
    assert answer.status_code == 502 and len(frontend.received) == 2


def test_the_read_deadline_answers_504_and_an_absent_frontend_502(door, frontend, model):
    frontend.delay_s = 2.5  # past the door's 1 s read deadline, on each of its 3 attempts
    started = time.monotonic()
    answer = chat(door)
    assert answer.status_code == 504, answer.text
    assert "read deadline" in answer.json()["error"]["message"]
    assert time.monotonic() - started < 10
    frontend.delay_s = 0.0
    served(door)
    nowhere = door_for("http://127.0.0.1:9", model)  # nothing listens on port 9
    try:
        answer = httpx.post(f"{nowhere.url}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        nowhere.stop()
    assert answer.status_code == 502 and "127.0.0.1:9" in answer.json()["error"]["message"]


ROLLOUT = (b'{"model":"tiny","prompt":[5,6,7],"max_tokens":2,"temperature":0.0,'
           b'"stream":false,"nvext":{"annotations":["rollout:{\\"v\\":1}"],'
           b'"extra_fields":["engine_data"]}}')


def rollout(door: str) -> httpx.Response:
    """A rollout as the fleet's driver sends it."""
    return httpx.post(f"{door}/v1/completions", content=ROLLOUT, timeout=30,
                      headers={"Content-Type": "application/json", "x-request-id": "r-1"})


def test_a_rollout_of_the_driver_passes_as_its_bytes_are(door, frontend):
    answer = rollout(door)
    assert answer.status_code == 200 and frontend.received == [ROLLOUT]
    assert answer.json()["nvext"]["engine_data"]["token_ids"] == GENERATED  # left in


def test_the_tokenizer_is_loaded_by_the_first_request_that_needs_it(frontend, tmp_path):
    """A door starts without its tokenizer: the driver's rollouts and /health never need it.
    Over a folder without one, what needs it is a 503 naming the folder, and the door serves
    on."""
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    door = door_for(frontend.url, folder)
    try:
        assert rollout(door.url).status_code == 200
        for path, body in (("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]}),
                           ("/inference/v1/generate", {"token_ids": [5, 6]}),
                           ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            answer = httpx.post(f"{door.url}{path}", json=body, timeout=30)
            assert answer.status_code == 503, (path, answer.text)
            assert f"the tokenizer of {folder} could not be loaded" in \
                answer.json()["error"]["message"]
        assert httpx.get(f"{door.url}/health", timeout=30).status_code == 200
        assert rollout(door.url).status_code == 200
    finally:
        door.stop()


def test_a_pinned_turn_whose_worker_is_gone_goes_to_another(door, frontend):
    chat(door, trajectory="pinned-1")  # served by instance 7, which is then gone
    frontend.unpinnable = {7}
    try:
        answer = chat(door, trajectory="pinned-1", messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"}])
    finally:
        frontend.unpinnable = set()
    assert answer.status_code == 200, answer.text
    sent = [json.loads(raw)["nvext"].get("backend_instance_id") for raw in frontend.received]
    assert sent == [None, 7, None]


def test_refusals_name_their_field_before_the_first_byte_and_the_next_is_served(door, frontend):
    long = [{"role": "user", "content": "weather " * 10}]
    with httpx.stream("POST", f"{door}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": long, "max_tokens": 120, "stream": True}) as answer:
        assert answer.status_code == 400
        refused = json.loads(answer.read())["error"]
    assert refused["param"] == "max_tokens" and f"max_model_len={MAX_MODEL_LEN}" in \
        refused["message"]
    served(door)
    answer = httpx.post(f"{door}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": [5, 6, 600, 7], "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt[2]"
    assert "token ID 600 at index 2" in answer.json()["error"]["message"]
    served(door)
    assert frontend.received and all(b"600" not in raw for raw in frontend.received)


def test_a_forgotten_trajectory_is_409_and_a_history_without_one_is_re_rendered(door, frontend):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": "and?"}]
    answer = chat(door, history, trajectory="never-recorded")
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["param"] == "trajectory"
    assert "never-recorded" in answer.json()["error"]["message"]
    assert not frontend.received
    answer = chat(door, history)
    assert answer.status_code == 200 and answer.headers[PROMPT_HEADER] == "re-rendered"
    assert PROMPT_HEADER not in chat(door).headers  # nothing earlier to re-render
    assert int(answer.headers[DOOR_PROCESS_HEADER]) > 0


def test_a_long_render_holds_a_render_thread_not_the_loop(frontend, model, tmp_path):
    """A template that takes seconds to render: meanwhile the same door answers /health."""
    slow = tmp_path / "slow.jinja"
    slow.write_text("{% set ns = namespace(x=0) %}{% for i in range(300) %}"
                    "{% for j in range(1000) %}{% set ns.x = ns.x + 1 %}{% endfor %}{% endfor %}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    server = thread_door(frontend.url, model, "tiny", {"custom_jinja_template": str(slow)},
                         max_model_len=MAX_MODEL_LEN)
    base = server.url
    try:
        rendering = threading.Thread(target=chat, args=(base,))
        started = time.monotonic()
        rendering.start()
        time.sleep(0.2)
        health = httpx.get(f"{base}/health", timeout=30)
        answered_in = time.monotonic() - started
        rendering.join()
        rendered_in = time.monotonic() - started
    finally:
        server.stop()
    assert health.status_code == 200
    assert rendered_in > 1.0 and answered_in < rendered_in / 2, (answered_in, rendered_in)
