"""Chat for agents, on a fleet of two real vLLM workers (local processes) serving a tiny model
whose chat template writes Hermes-style tool calls, registered with Dynamo's ``hermes``
parser: through the official ``openai`` client, a ``tool_choice`` that names a function is
served by structured decoding in vLLM, so even random weights answer with a call that parses
against the tool's schema. The fleet is started once for the module."""

from __future__ import annotations

import json

import openai
import pytest

from rollout_fleet.adapters.tiny_model.build import TinyModelSpec, build_tiny_model
from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.fleet import Fleet

pytestmark = [pytest.mark.vllm, pytest.mark.dynamo]
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False}}}
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tool-model"), spec=TinyModelSpec(tool_calls=True))


@pytest.fixture(scope="module")
def fleet(tool_model, tmp_path_factory):
    fleet = Fleet.start(parse_config({
        "engine": {"kind": "vllm"}, "placement": "local", "num_workers": 2,
        "model": str(tool_model), "max_model_len": 512, "chat": {"tool_call_parser": "hermes"},
        "run_dir": str(tmp_path_factory.mktemp("agent-fleet") / "run"),
        "timeouts": {"start_s": 400}}))
    try:
        yield fleet
    finally:
        fleet.shutdown()


@pytest.fixture(scope="module")
def client(fleet):
    with openai.OpenAI(base_url=f"{fleet.frontend_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as client:
        yield client


def test_a_named_tool_choice_answers_a_parsed_call_that_fits_the_schema(client):
    for attempt in range(4):  # round-robin: both workers serve it
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "What is the weather?"}],
            tools=[WEATHER_TOOL], tool_choice=CALL_WEATHER, max_tokens=96, seed=attempt,
            temperature=1.0)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in CITIES


def test_a_bad_tool_choice_is_refused_by_name_and_the_fleet_serves_on(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=4)
    assert "get_time" in str(refused.value)
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.usage.completion_tokens >= 1
