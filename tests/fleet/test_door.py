"""The fleet's door, the URL ``Fleet.start`` hands out (``fleet.door_url``): three door processes
behind one port (``wiring/door.py``: SO_REUSEPORT, ``[door] processes = 3``), a SQLite
trajectory store they share, in front of a fleet of two real vLLM workers (local processes)
behind the real frontend, serving a tiny model that writes Hermes-style tool calls. The official ``openai`` client gets completions, chat, streams,
``n = 2`` and logprobs at the door's URL; vLLM's ``return_token_ids`` and its token-in/token-out
``/inference/v1/generate`` (the same tokens as the fleet's own rollout client, a session pinned
to one worker); a tool loop named only by its trajectory stays token-exact while different door
processes answer its turns, and after the process that answered one is killed; refusals come
with their status and name what they refuse, and the next request is served. The fleet (its
door with it) starts once for the module; the last test kills a door process; the fleet's
shutdown leaves none of them."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from rollout_fleet.adapters.agent_door.replies import DOOR_PROCESS_HEADER, WORKER_HEADER
from rollout_fleet.adapters.agent_door.requests import TRAJECTORY_HEADER
from rollout_fleet.adapters.http import HttpCompletionsTransport
from rollout_fleet.adapters.tiny_model.build import TinyModelSpec, build_tiny_model
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.rollout_client import RolloutClient
from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before

pytestmark = [pytest.mark.vllm, pytest.mark.dynamo]
MODEL = "tiny-tools"
MAX_MODEL_LEN = 512
DOOR_PROCESSES = 3
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                            "enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("door-model"),
                             spec=TinyModelSpec(tool_calls=True))
    before = own_children_before()
    fleet = Fleet.start(parse_config({
        "model": str(model), "served_model_name": MODEL, "placement": "local",
        "num_workers": 2, "router": "round-robin", "max_model_len": MAX_MODEL_LEN,
        "engine": {"kind": "vllm", "dtype": "float32", "enforce_eager": True,
                   "extra_engine_args": {"logprobs_mode": "processed_logprobs"}},
        "chat": {"tool_call_parser": "hermes"}, "door": {"processes": DOOR_PROCESSES},
        "run_dir": str(tmp_path_factory.mktemp("door-fleet") / "run"),
        "timeouts": {"start_s": 400}}))
    try:
        ports = fleet_ports(fleet)
        assert fleet.door is not None and fleet.door_url == fleet.door.url
        assert len(fleet.door.pids) == DOOR_PROCESSES
        yield fleet
    finally:
        groups = fleet.process_groups()  # the door's processes, replacements too
        fleet.shutdown()
    assert_nothing_left(groups, ports, before)


@pytest.fixture(scope="module")
def door(fleet):
    return fleet.door


@pytest.fixture
def client(fleet):
    with openai.OpenAI(base_url=f"{fleet.door_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as client:
        yield client


def test_the_official_client_gets_completions_chat_streams_groups_and_logprobs(client):
    completion = client.completions.create(model=MODEL, prompt="The weather is", max_tokens=6,
                                           temperature=0, logprobs=1)
    (choice,) = completion.choices
    assert len(choice.logprobs.token_logprobs) == completion.usage.completion_tokens > 0
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=6,
        temperature=0, logprobs=True)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens > 0
    pieces = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=6,
        temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == \
        chat.choices[0].message.content
    streamed = list(client.completions.create(model=MODEL, prompt="The weather is",
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in streamed if p.choices) == choice.text
    pair = client.completions.create(model=MODEL, prompt="The weather is", max_tokens=6, n=2,
                                     seed=3, temperature=1.0, logprobs=0)
    assert [c.index for c in pair.choices] == [0, 1]
    assert all(len(c.logprobs.token_logprobs) > 0 for c in pair.choices)
    chats = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=6, n=2,
        seed=3, temperature=1.0)
    assert len(chats.choices) == 2


def test_return_token_ids_on_completions_and_chat(client, fleet):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fleet.model_path)
    completion = client.completions.create(model=MODEL, prompt="The weather is", max_tokens=5,
                                           temperature=0, extra_body={"return_token_ids": True})
    (choice,) = completion.choices
    assert choice.prompt_token_ids == tokenizer("The weather is")["input_ids"]
    assert len(choice.token_ids) == completion.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=5,
        temperature=0, extra_body={"return_token_ids": True})
    assert chat.prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather?"}], tokenize=True, add_generation_prompt=True,
        return_dict=False)
    assert chat.choices[0].token_ids == chat.choices[0].message.generation_token_ids


def test_generate_answers_the_rollout_clients_tokens_and_pins_a_session(door, fleet):
    """Greedy prompts: vLLM's token-in/token-out answer (its shape) carries the tokens and
    logprobs the fleet's own rollout client gets from the frontend, and from the door, which
    passes the client's rollouts on as they are. A session's requests all reach one worker
    (the door names it in a header), where round-robin alone alternates between the two."""
    prompts = [[5, 60, 61, 62], [7, 80, 81, 82, 83, 84], [9, 100, 101]]

    async def rollouts(url: str) -> list:
        transport = HttpCompletionsTransport(url)
        client = RolloutClient(transport, model=MODEL)
        try:
            return [await client.rollout(RolloutRequest(f"r{i}", p, 8))
                    for i, p in enumerate(prompts)]
        finally:
            await transport.aclose()

    direct, through_door = asyncio.run(rollouts(fleet.frontend_url)), asyncio.run(
        rollouts(door.url))
    for prompt, expected, passed in zip(prompts, direct, through_door):
        answer = httpx.post(f"{door.url}/inference/v1/generate", timeout=120, json={
            "token_ids": prompt, "return_token_ids": True,
            "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0}})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["output_mode"] == "tokens" and body["prompt_token_ids"] == prompt
        (choice,) = body["choices"]
        assert choice["token_ids"] == list(expected.token_ids) == list(passed.token_ids)
        assert [e["token_id"] for e in choice["logprobs"]["content"]] == choice["token_ids"]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
            list(expected.logprobs), abs=1e-4)
        assert choice["finish_reason"] == expected.finish_reason.value
        assert choice["weight_versions"] == [{"version": "0", "start": 0,
                                              "end": len(choice["token_ids"])}]

    def served_by(session: str | None) -> int:
        answer = httpx.post(f"{door.url}/inference/v1/generate", timeout=120,
                            headers={"X-Session-ID": session} if session else {}, json={
                                "token_ids": prompts[0], "sampling_params": {"max_tokens": 2}})
        assert answer.status_code == 200, answer.text
        return int(answer.headers[WORKER_HEADER])

    assert len({served_by(None) for _ in range(2)}) == 2  # round-robin: one each
    assert len({served_by("session-1") for _ in range(4)}) == 1


class DoorConnection:
    """One kept-alive connection to the door: always the same door process answers it."""

    def __init__(self, door) -> None:
        address = urlsplit(door.url)
        self.http = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
        self.pid = int(self.request("GET", "/health")[1][DOOR_PROCESS_HEADER])

    def request(self, method: str, path: str, body: dict | None = None,
                headers: dict | None = None) -> tuple[int, dict, dict]:
        self.http.request(method, path, body=None if body is None else json.dumps(body),
                          headers={"Content-Type": "application/json", **(headers or {})})
        answer = self.http.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, \
            json.loads(answer.read() or b"null")


def connections_to_distinct_processes(door, wanted: int) -> list[DoorConnection]:
    """A connection to each of ``wanted`` door processes (the kernel spreads new ones)."""
    by_pid: dict[int, DoorConnection] = {}
    for _ in range(60):
        connection = DoorConnection(door)
        if connection.pid in by_pid:
            connection.http.close()
        else:
            by_pid[connection.pid] = connection
        if len(by_pid) == wanted:
            return list(by_pid.values())
    raise AssertionError(f"60 connections reached only door processes {sorted(by_pid)}")


def tool_turn(connection: DoorConnection, messages: list[dict], trajectory: str,
              seed: int) -> tuple[dict, str]:
    status, headers, answer = connection.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "tools": [WEATHER_TOOL],
        "tool_choice": CALL_WEATHER, "max_tokens": 96, "seed": seed, "temperature": 1.0,
        "return_token_ids": True}, {TRAJECTORY_HEADER: trajectory})
    assert status == 200, answer
    return answer, headers[DOOR_PROCESS_HEADER]


def as_an_agent_sends_it(message: dict) -> dict:
    """Role, text and tool calls: no token IDs."""
    return {"role": "assistant", "content": message["content"],
            "tool_calls": message["tool_calls"]}


def next_messages(messages: list[dict], answer: dict) -> list[dict]:
    message = answer["choices"][0]["message"]
    (call,) = message["tool_calls"]
    return [*messages, as_an_agent_sends_it(message),
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]


def exact_tokens(answer: dict) -> list[int]:
    return answer["prompt_token_ids"] + answer["choices"][0]["token_ids"]


def test_a_tool_loop_named_by_its_trajectory_is_token_exact_across_door_processes(door):
    one, two = connections_to_distinct_processes(door, 2)
    messages = [{"role": "user", "content": "What is the weather in three cities?"}]
    earlier, answered_by = None, []
    for turn, connection in enumerate([one, two, one]):
        answer, pid = tool_turn(connection, messages, "door-loop-1", seed=turn)
        if earlier is not None:
            prompt = answer["prompt_token_ids"]
            assert prompt[:len(earlier)] == earlier and len(prompt) > len(earlier), turn
        earlier, messages = exact_tokens(answer), next_messages(messages, answer)
        answered_by.append(int(pid))
    assert answered_by == [one.pid, two.pid, one.pid] and one.pid != two.pid


def test_a_trajectory_the_fleet_no_longer_holds_is_refused_by_name_then_served(door):
    (connection,) = connections_to_distinct_processes(door, 1)
    messages = [{"role": "user", "content": "Weather?"}]
    answer, _ = tool_turn(connection, messages, "door-ended-1", seed=1)
    assert httpx.delete(f"{door.url}/v1/trajectories/door-ended-1", timeout=30).json()[
        "ended"]
    for name in ("door-ended-1", "door-never-recorded"):
        status, _, refused = connection.request("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": next_messages(messages, answer), "max_tokens": 4},
            {TRAJECTORY_HEADER: name})
        assert status == 409, refused
        assert refused["error"]["param"] == "trajectory" and name in refused["error"]["message"]
    tool_turn(connection, messages, "door-ended-2", seed=2)  # served


def test_a_streamed_turn_over_the_context_is_400_naming_the_limit_then_served(door, client):
    with httpx.stream("POST", f"{door.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": MAX_MODEL_LEN, "stream": True}) as answer:
        assert answer.status_code == 400
        refused = json.loads(answer.read())["error"]
    assert refused["param"] == "max_tokens"
    assert f"context length of {MAX_MODEL_LEN} tokens" in refused["message"]
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=4).choices


def test_a_token_outside_the_vocabulary_is_400_naming_its_index_and_id_then_served(door, fleet):
    from transformers import AutoTokenizer

    vocabulary = len(AutoTokenizer.from_pretrained(fleet.model_path))
    answer = httpx.post(f"{door.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": [5, 6, vocabulary + 3], "max_tokens": 2})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "prompt[2]"
    assert f"token ID {vocabulary + 3} at index 2" in answer.json()["error"]["message"]
    answer = httpx.post(f"{door.url}/inference/v1/generate", timeout=120, json={
        "token_ids": [vocabulary], "sampling_params": {"max_tokens": 2}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "token_ids[0]"
    answer = httpx.post(f"{door.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert answer.status_code == 200, answer.text


# Last in the module: it kills a door process.
def test_a_killed_door_process_loses_no_trajectory_and_is_replaced(door):
    (connection,) = connections_to_distinct_processes(door, 1)
    messages = [{"role": "user", "content": "What is the weather?"}]
    first, pid = tool_turn(connection, messages, "door-killed-1", seed=31)
    os.kill(int(pid), signal.SIGKILL)
    connection.http.close()
    deadline = time.monotonic() + 30
    while int(pid) in door.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = set(door.alive())
    assert int(pid) not in survivors and len(survivors) == DOOR_PROCESSES - 1
    (other,) = connections_to_distinct_processes(door, 1)
    second, answered_by = tool_turn(other, next_messages(messages, first), "door-killed-1",
                                    seed=32)
    assert int(answered_by) in survivors
    earlier = exact_tokens(first)
    assert second["prompt_token_ids"][:len(earlier)] == earlier
    (replacement,) = door.replace_dead()
    assert set(door.alive()) == survivors | {replacement}
    reached = {c.pid for c in connections_to_distinct_processes(door, DOOR_PROCESSES)}
    assert reached == survivors | {replacement}
