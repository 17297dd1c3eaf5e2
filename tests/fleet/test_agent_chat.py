"""Chat for agents, on a fleet of two real vLLM workers (local processes) started by NeMo-RL's
drop-in with ``expose_http_server`` and the ``hermes`` tool-call parser, serving a tiny model
whose chat template writes Hermes-style tool calls. Through the official ``openai`` client: a
``tool_choice`` that names a function is served by structured decoding in vLLM, so even random
weights answer with a call that parses against the tool's schema; through the agent door at
the drop-in's ``dp_openai_server_base_urls``, every turn of a trajectory starts with the exact
tokens of the turn before it. The fleet is started once for the module; its last test kills one
of the two workers."""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Literal

import httpx
import openai
import pytest

from rollout_fleet.adapters.agent_door.requests import TRAJECTORY_HEADER
from rollout_fleet.adapters.http.metrics import HttpWorkerMetrics
from rollout_fleet.adapters.tiny_model.build import TinyModelSpec, build_tiny_model
from rollout_fleet.wiring.nemo_rl import DynamoGeneration
from tests.support.nemo_gym_contract import (
    gym_history_message, gym_request, gym_tokens, without_inline_ids, without_message_tokens,
)
from tests.support.served_app import thread_door
from tests.support.teacher_forced import teacher_forced_logprobs
from tests.unit.test_nemo_rl_config import generation_config

pytestmark = [pytest.mark.vllm, pytest.mark.dynamo]
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False}}}
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tool-model"),
                            spec=TinyModelSpec(tool_calls=True))


@pytest.fixture(scope="module")
def dropin(tool_model, tmp_path_factory):
    """NeMo-RL's drop-in, as a NeMo-Gym recipe configures it: the hermes parser in its
    worker_args and ``expose_http_server``, which serves the agent door."""
    config = generation_config(tool_model, max_model_len=512, expose_http_server=True)
    config["dynamo_cfg"]["worker_args"] = {"tool_call_parser": "hermes"}
    config["rollout_fleet"] = {"placement": "local", "num_workers": 2,
                               "run_dir": str(tmp_path_factory.mktemp("agent-fleet") / "run"),
                               "timeouts": {"start_s": 400}}
    generation = DynamoGeneration(None, config)
    try:
        yield generation
    finally:
        generation.shutdown()


@pytest.fixture(scope="module")
def fleet(dropin):
    return dropin._fleet


@pytest.fixture(scope="module")
def model(dropin):
    return dropin.settings.fleet.served_model_name


@pytest.fixture(scope="module")
def client(fleet):
    with openai.OpenAI(base_url=f"{fleet.frontend_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as client:
        yield client


def test_a_named_tool_choice_answers_a_parsed_call_that_fits_the_schema(client, model):
    for attempt in range(4):  # round-robin: both workers serve it
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the weather?"}],
            tools=[WEATHER_TOOL], tool_choice=CALL_WEATHER, max_tokens=96, seed=attempt,
            temperature=1.0)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in CITIES


def test_a_bad_tool_choice_is_refused_by_name_and_the_fleet_serves_on(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=4)
    assert "get_time" in str(refused.value)
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.usage.completion_tokens >= 1


# -- the agent door: token-exact turns --------------------------------------------------------
# The contract of NeMo-Gym's token-carrying messages, restated: an assistant message the
# client sends back may carry the turn's prompt IDs, the IDs the model generated and their
# logprobs; the next turn's prompt must then begin with exactly prompt + generated IDs, and
# each answer's message carries the same three fields for its own turn.
GYM_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@pytest.fixture(scope="module")
def door(dropin, fleet) -> str:
    """The fleet's own door, as the drop-in names it to NeMo-Gym (and as its frontend_url)."""
    (url,) = dropin.dp_openai_server_base_urls
    assert url == dropin.frontend_url == f"{fleet.door_url}/v1"
    assert url.startswith("http://127.0.0.1:")
    return url


def door_client(door: str, trajectory: str | None = None) -> openai.OpenAI:
    headers = {TRAJECTORY_HEADER: trajectory} if trajectory else None
    return openai.OpenAI(base_url=door, api_key="unused", timeout=120, max_retries=0,
                         default_headers=headers)


def as_an_agent_sends_it(message) -> dict:
    """The assistant message as agent frameworks send it back: role, text and tool calls
    only (no token IDs)."""
    sent = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        sent["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.function.name,
                                            "arguments": call.function.arguments}}
                              for call in message.tool_calls]
    return sent


def tool_turn(client, model: str, messages: list[dict], seed: int):
    return client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice=CALL_WEATHER,
        max_tokens=96, seed=seed, temperature=1.0,
        extra_body={"return_token_ids": True, "nvext": {"extra_fields": ["worker_id"]}})


def served_by(answer) -> int:
    return answer.nvext["worker_id"]["decode_worker_id"]


def prefix_cache_counts(fleet) -> dict[str, tuple[float, float]]:
    """Each worker's running (prompt tokens queried, prefix-cache hits), read from its
    /metrics as the driver reads them."""
    async def sample():
        loads = await asyncio.gather(*(HttpWorkerMetrics(e.worker_id, e.system_url).sample()
                                       for e in fleet.endpoints()))
        return {load.worker_id: (load.prefix_cache_queried_tokens, load.prefix_cache_hit_tokens)
                for load in loads}
    return asyncio.run(sample())


def test_tool_turns_named_by_trajectory_start_with_the_last_turns_exact_tokens(door, model,
                                                                               fleet):
    """... and every turn is served by the worker that served the first, which holds the
    trajectory's prefix (round-robin alone would alternate between the two workers): each
    later turn's answer reports its prefix-cache hit in ``usage.prompt_tokens_details``, and
    that worker's metrics count them."""
    messages = [{"role": "user", "content": "What is the weather in three cities?"}]
    earlier: list[int] | None = None
    workers, prompt_tokens, hits = [], 0, 0
    counts_before = prefix_cache_counts(fleet)
    with door_client(door, trajectory="weather-1") as client:
        for turn in range(3):
            answer = tool_turn(client, model, messages, seed=turn)
            choice, message = answer.choices[0], answer.choices[0].message
            (call,) = message.tool_calls  # parsed by Dynamo's hermes parser
            city = json.loads(call.function.arguments)["city"]
            prompt, generated = answer.prompt_token_ids, choice.token_ids
            assert message.prompt_token_ids == prompt and message.generation_token_ids == generated
            assert len(message.generation_log_probs) == len(generated) > 0
            assert message.weight_version == 0  # the weights the workers started with
            assert message.weight_versions == [[0, len(generated)]]  # every token's, run-length
            cached = answer.usage.prompt_tokens_details.cached_tokens
            assert 0 <= cached <= len(prompt)
            if earlier is not None:
                assert prompt[:len(earlier)] == earlier, f"turn {turn} re-tokenized its prefix"
                assert len(prompt) > len(earlier)  # and the tool's answer follows it
                # The worker held the earlier turns: their whole KV blocks were prefix-cache
                # hits (vLLM-CPU's blocks are 128 tokens; more than half the earlier tokens).
                assert cached > len(earlier) // 2, (turn, cached, len(earlier))
            earlier = prompt + generated
            prompt_tokens, hits = prompt_tokens + len(prompt), hits + cached
            workers.append(served_by(answer))
            messages += [as_an_agent_sends_it(message),
                         {"role": "tool", "tool_call_id": call.id, "content": f"sunny in {city}"}]
    assert len(messages) == 7
    assert len(set(workers)) == 1, workers
    # The serving worker's metrics count every turn's prompt tokens and prefix-cache hits.
    (holder,) = [n for n, instance in fleet.instance_ids.items() if instance == workers[0]]
    counts_after = prefix_cache_counts(fleet)
    assert {name: (after[0] - counts_before[name][0], after[1] - counts_before[name][1])
            for name, after in counts_after.items()} == {
        name: (prompt_tokens, hits) if name == holder else (0, 0) for name in counts_after}
    with door_client(door) as client:  # unnamed turns are routed as ever: round-robin
        alone = {served_by(tool_turn(client, model, messages[:1], seed=9)) for _ in range(2)}
    assert len(alone) == 2, alone


def test_token_fields_on_an_assistant_message_are_the_prompts_exact_prefix(door, model):
    """A NeMo-Gym-shaped request: the tokens it carries are taken as they are, even where a
    re-tokenization of the message's text would give others."""
    with door_client(door) as client:
        first = tool_turn(client, model, [{"role": "user", "content": "Weather?"}], seed=5)
    message = first.choices[0].message
    carried = {"prompt_token_ids": message.prompt_token_ids,
               "generation_token_ids": message.generation_token_ids[:-1] + [7, 8, 2],
               "generation_log_probs": message.generation_log_probs}
    sent = [{"role": "user", "content": "Weather?"}, {**as_an_agent_sends_it(message), **carried},
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "rain"}]
    answer = httpx.post(f"{door}/chat/completions", timeout=120, json={
        "model": model, "messages": sent, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    prefix = carried["prompt_token_ids"] + carried["generation_token_ids"]
    prompt = answer.json()["choices"][0]["message"]["prompt_token_ids"]
    assert prompt[:len(prefix)] == prefix and len(prompt) > len(prefix)


def test_a_turn_that_does_not_continue_its_trajectory_is_refused_naming_it(door, model):
    with door_client(door, trajectory="weather-2") as client:
        tool_turn(client, model, [{"role": "user", "content": "Weather?"}], seed=1)
        with pytest.raises(openai.BadRequestError) as refused:
            tool_turn(client, model, [{"role": "user", "content": "Weather?"},
                               {"role": "user", "content": "again"}], seed=2)
        assert "messages[1]" in str(refused.value)
        assert "assistant" in str(refused.value)
    with door_client(door) as client:  # the door and the fleet serve on
        assert tool_turn(client, model, [{"role": "user", "content": "Weather?"}], seed=3).choices
    ended = httpx.delete(f"{door}/trajectories/weather-2", timeout=10).json()
    assert ended == {"trajectory": "weather-2", "ended": True}
    again = httpx.delete(f"{door}/trajectories/weather-2", timeout=10).json()
    assert again == {"trajectory": "weather-2", "ended": False}  # forgotten


def test_completions_return_their_prompt_and_generated_token_ids(door, model, tool_model):
    from transformers import AutoTokenizer

    answer = httpx.post(f"{door}/completions", timeout=120, json={
        "model": model, "prompt": "The weather is", "max_tokens": 5, "temperature": 0,
        "logprobs": 1, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    assert choice["prompt_token_ids"] == tokenizer("The weather is")["input_ids"]
    assert len(choice["token_ids"]) == 5
    assert len(choice["logprobs"]["token_logprobs"]) == 5


def test_a_streamed_turn_comes_in_pieces_and_the_next_turn_continues_its_exact_tokens(door,
                                                                                     model):
    """Streamed through the door (chunks relayed as the frontend sends them): the same turn as
    unstreamed, token for token; its tokens are kept for the trajectory's next turn."""
    messages = [{"role": "user", "content": "Stream me the weather."}]
    # 48 tokens: vLLM merges the steps a starved front has not read yet into one piece, and on
    # a host running two test sessions at once 12 tokens once came as one.
    asked = dict(model=model, max_tokens=48, seed=2, temperature=1.0,
                 extra_body={"return_token_ids": True})
    with door_client(door, trajectory="streamed-1") as client:
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **asked))
        pieces = [c.choices[0] for c in chunks if c.choices]
        generated = [t for piece in pieces for t in (piece.token_ids or [])]
        text = "".join(piece.delta.content or "" for piece in pieces)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "And tomorrow?"}]
        following = client.chat.completions.create(messages=messages, **asked)
    with door_client(door) as client:
        whole = client.chat.completions.create(messages=messages[:1], **asked)
    assert len(pieces) > 2, "the turn came in one piece"
    assert generated == whole.choices[0].token_ids and text == whole.choices[0].message.content
    assert pieces[-1].delta.generation_token_ids == generated
    earlier = chunks[0].prompt_token_ids + generated
    assert following.prompt_token_ids[:len(earlier)] == earlier


def test_n_samples_of_a_prompt_are_one_group_each_choice_its_own_seeds_sample(door, model):
    """The official client asks the door for n=4 (a GRPO group): one request, served by one
    worker with vLLM's own n; choice i is what a single request with seed + i samples."""
    asked = dict(model=model, prompt="The weather is", max_tokens=8, temperature=1.0, logprobs=1,
                 extra_body={"return_token_ids": True})
    with door_client(door) as client:
        group = client.completions.create(n=4, seed=11, **asked)
        alone = [client.completions.create(seed=11 + i, **asked).choices[0] for i in range(4)]
    assert [choice.index for choice in group.choices] == [0, 1, 2, 3]
    assert len({tuple(choice.token_ids) for choice in group.choices}) > 1  # four seeds, used
    for grouped, single in zip(group.choices, alone):
        assert grouped.token_ids == single.token_ids and grouped.text == single.text
        assert grouped.finish_reason == single.finish_reason
        assert grouped.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs,
                                                                abs=1e-3)
    assert group.usage.completion_tokens == sum(len(c.token_ids) for c in group.choices)


def test_a_group_that_asks_for_no_logprobs_gets_the_same_samples_without_them(door, model):
    """A completion group without ``logprobs`` (what a GRPO trainer that recomputes them sends):
    drawn without them, the same samples as the group that asks for them."""
    asked = dict(model=model, prompt="The weather is", max_tokens=8, temperature=1.0, n=4,
                 seed=5, extra_body={"return_token_ids": True})
    with door_client(door) as client:
        bare = client.completions.create(**asked)
        with_logprobs = client.completions.create(logprobs=0, **asked)
    assert [c.logprobs for c in bare.choices] == [None] * 4
    assert all(len(c.logprobs.token_logprobs) == len(c.token_ids) for c in with_logprobs.choices)
    assert [c.token_ids for c in bare.choices] == [c.token_ids for c in with_logprobs.choices]
    assert len({tuple(c.token_ids) for c in bare.choices}) > 1


def test_a_chat_group_answers_n_messages_and_what_a_group_cannot_serve_is_refused(door, model):
    messages = [{"role": "user", "content": "Weather?"}]
    with door_client(door) as client:
        group = client.chat.completions.create(model=model, messages=messages, n=3, seed=4,
                                               max_tokens=8, temperature=1.0)
        assert len(group.choices) == 3
        prompts = {tuple(choice.message.prompt_token_ids) for choice in group.choices}
        assert len(prompts) == 1  # one prompt, three samples of it
        for choice in group.choices:
            assert len(choice.message.generation_log_probs) == len(
                choice.message.generation_token_ids) > 0
        with pytest.raises(openai.BadRequestError, match="tools"):  # parsed per single choice
            client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=4,
                                           tools=[WEATHER_TOOL])
    with door_client(door, trajectory="group-1") as client, \
            pytest.raises(openai.BadRequestError, match="trajectory"):
        client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=4)


def test_a_streamed_completion_is_passed_on_as_the_frontend_writes_it(door, model):
    asked = dict(model=model, prompt="The weather is", max_tokens=8, seed=3, temperature=1.0)
    with door_client(door) as client:
        chunks = list(client.completions.create(stream=True, **asked))
        whole = client.completions.create(**asked)
    assert len([c for c in chunks if c.choices]) > 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    with door_client(door) as client, pytest.raises(openai.BadRequestError, match="return_token_ids"):
        list(client.completions.create(stream=True, extra_body={"return_token_ids": True}, **asked))


def test_vllms_benchmark_client_with_n_4_gets_every_group_through_the_door(door, model,
                                                                          tool_model, tmp_path):
    """``vllm bench serve`` as shipped (streamed completions, its neutral sampling fields and
    ``ignore_eos``) with ``--extra-body '{"n": 4}'``: every request answered, each one's usage
    counting the tokens of its four choices (a streamed group: one event per choice)."""
    from support.vllm_bench_client import bench_serve_outcome, first_errors

    prompts, output_len, n = 6, 8, 4
    outcome = bench_serve_outcome(tmp_path, [
        "--backend", "openai", "--base-url", door.removesuffix("/v1"),
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tool_model),
        "--dataset-name", "random", "--random-input-len", "16",
        "--random-output-len", str(output_len), "--num-prompts", str(prompts),
        "--max-concurrency", "3", "--seed", "0", "--disable-tqdm",
        "--extra-body", json.dumps({"n": n, "seed": 5, "temperature": 1.0})])
    assert (outcome["completed"], outcome["failed"]) == (prompts, 0), first_errors(outcome)
    # The client asks ignore_eos with its random dataset: each request's usage counts n whole
    # budgets.
    assert outcome["total_output_tokens"] == prompts * n * output_len


def test_chat_on_a_model_without_a_template_is_refused_naming_the_model(fleet, tool_model,
                                                                         tmp_path):
    bare = tmp_path / "bare-model"
    shutil.copytree(tool_model, bare)
    config_path = bare / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    server = thread_door(fleet.frontend_url, bare, "bare-tiny", max_model_len=512)
    try:
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "bare-tiny", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        server.stop()
    assert answer.status_code == 400
    assert "model=bare-tiny" in answer.json()["error"]["message"]
    assert "no chat template" in answer.json()["error"]["message"]


# A template that refuses a system message, as many shipped templates refuse what they cannot
# render (jinja's raise_exception, which transformers provides).
REFUSING_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{{ raise_exception('this template takes no system message') }}{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


def refused_field(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]["param"]


def test_bad_turns_are_refused_naming_the_field_and_the_door_serves_on(door, model, fleet,
                                                                       tool_model, tmp_path):
    """Tool-call arguments in the history that do not parse, template kwargs that are not an
    object, a template that raises on the conversation: each a 400 naming the field, and the
    next good turn is served."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": Paris'}}
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    chat = f"{door}/chat/completions"
    answer = httpx.post(chat, timeout=60, json={"model": model, "messages": history})
    assert refused_field(answer) == "messages[1].tool_calls[0].function.arguments"
    assert '{"city": Paris' in answer.json()["error"]["message"]
    answer = httpx.post(chat, timeout=60, json={
        "model": model, "messages": history[:1], "chat_template_kwargs": ["thinking"]})
    assert refused_field(answer) == "chat_template_kwargs"

    template = tmp_path / "refusing.jinja"
    template.write_text(REFUSING_TEMPLATE)
    strict = thread_door(fleet.frontend_url, tool_model, model,
                         {"custom_jinja_template": str(template)}, max_model_len=512)
    try:
        answer = httpx.post(f"{strict.url}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4,
            "messages": [{"role": "system", "content": "Be brief."}, *history[:1]]})
        assert refused_field(answer) == "messages"
        assert "this template takes no system message" in answer.json()["error"]["message"]
        served = httpx.post(f"{strict.url}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": history[:1]})
        assert served.status_code == 200, served.text
    finally:
        strict.stop()
    call["function"]["arguments"] = '{"city": "Paris"}'
    served = httpx.post(chat, timeout=60, json={"model": model, "max_tokens": 4,
                                                "messages": history})
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["generation_token_ids"]


def test_an_openai_agents_run_gets_token_exact_turns_by_its_trajectory_name(door, model,
                                                                            tool_model):
    """The openai-agents SDK (a client no one here wrote) runs a tool-use loop of three model
    turns; it sends text only, and names its trajectory in a header. Each answer the door
    gave (read off the wire) starts its prompt with the turn before it, exactly, and every
    turn's logprobs are those the model gave under the tool's grammar: never below a
    transformers forward of the whole final sequence (the grammar only takes tokens away), and
    0 where it left one token."""
    import agents

    agents.set_tracing_disabled(True)  # nothing leaves loopback
    answers, called = [], []

    async def keep_answer(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            await response.aread()
            answers.append(response.json())

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    async def run() -> None:
        http = httpx.AsyncClient(event_hooks={"response": [keep_answer]}, timeout=120)
        client = openai.AsyncOpenAI(base_url=door, api_key="unused", http_client=http,
                                    max_retries=0,
                                    default_headers={TRAJECTORY_HEADER: "agents-sdk-1"})
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather.", tools=[get_weather],
            model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=96,
                                                temperature=1.0),
            reset_tool_choice=False)  # every turn calls the tool: the run ends at max_turns
        try:
            with pytest.raises(agents.MaxTurnsExceeded):
                await agents.Runner.run(agent, "Weather in three cities, please.", max_turns=3)
        finally:
            await http.aclose()

    asyncio.run(run())
    assert len(answers) == 3 and len(called) == 3, (len(answers), called)
    earlier = None
    for turn, answer in enumerate(answers):
        message = answer["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
        prompt = message["prompt_token_ids"]
        if earlier is not None:
            assert prompt[:len(earlier)] == earlier, f"turn {turn} re-tokenized its prefix"
        earlier = prompt + message["generation_token_ids"]
    # The trajectory a trainer would train on: the last turn's prompt and generated tokens.
    reference = teacher_forced_logprobs(tool_model, earlier)
    for turn, answer in enumerate(answers):
        message = answer["choices"][0]["message"]
        start, generated = len(message["prompt_token_ids"]), message["generation_token_ids"]
        assert earlier[start:start + len(generated)] == generated
        for served, free in zip(message["generation_log_probs"],
                                reference[start:start + len(generated)], strict=True):
            assert served >= free - 1e-4, f"turn {turn}: {served} below the model's {free}"
    forced = [lp for a in answers for lp in a["choices"][0]["message"]["generation_log_probs"]]
    assert 0.0 in forced and min(forced) < 0.0  # the grammar forced some tokens, not all


def test_a_free_text_trajectory_has_the_logprobs_of_a_forward_of_its_final_tokens(
        door, model, tool_model):
    """Three sampled turns by trajectory name, no grammar: every turn's logprobs equal a
    transformers forward of the whole final sequence (float32, within 1e-4)."""
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    answers = []
    with door_client(door, trajectory="free-text-1") as client:
        for turn in range(3):
            answer = client.chat.completions.create(
                model=model, messages=messages, max_tokens=12, seed=turn, temperature=1.0)
            message = answer.choices[0].message
            answers.append(message)
            messages += [{"role": "assistant", "content": message.content},
                         {"role": "user", "content": f"And tomorrow, day {turn}?"}]
    assert sum(len(m.generation_token_ids) for m in answers) > 3  # tokens to compare
    final = answers[-1].prompt_token_ids + answers[-1].generation_token_ids
    reference = teacher_forced_logprobs(tool_model, final)
    for turn, message in enumerate(answers):
        start, generated = len(message.prompt_token_ids), message.generation_token_ids
        assert final[start:start + len(generated)] == generated, f"turn {turn} not a prefix"
        assert message.generation_log_probs == pytest.approx(
            reference[start:start + len(generated)], abs=1e-4), f"turn {turn}"


def gym_turn(door: str, body: dict, *, inline_ids: bool) -> tuple[dict, dict, dict]:
    """One turn as NeMo-Gym's policy client sends and reads it: (its request, the door's
    answer, the token fields it reads from the first source present)."""
    request = gym_request(body, inline_ids=inline_ids)
    answer = httpx.post(f"{door}/chat/completions", json=request, timeout=120)
    assert answer.status_code == 200, answer.text
    tokens, source = gym_tokens(answer.json(), request, lambda b: gym_tokenize(door, b))
    assert source == "message"
    return request, answer.json(), tokens


def gym_tokenize(door: str, body: dict) -> dict:
    answer = httpx.post(f"{door.removesuffix('/v1')}/tokenize", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_nemo_gyms_policy_client_reads_exact_turns_from_each_of_its_sources(door, model):
    """Three tool turns as NeMo-Gym's client drives a policy server (its request fields, its
    token fields carried back on the assistant messages, NeMo-RL's ``required_prefix_token_ids``
    on the last turn): each turn's prompt starts with the last turn's exact tokens, and the
    tokens read from the message equal those read from vLLM's inline IDs, from the
    ``token_id:<int>`` logprob entries and from the door's ``/tokenize``."""
    messages = [{"role": "user", "content": "Weather in two cities?"}]
    earlier = None
    for turn in range(3):
        body = {"model": model, "messages": messages, "tools": [WEATHER_TOOL],
                "tool_choice": CALL_WEATHER, "max_tokens": 64, "temperature": 1.0, "seed": turn}
        if turn == 2:
            body["required_prefix_token_ids"] = (earlier["prompt_token_ids"]
                                                 + earlier["generation_token_ids"])
        request, answer, tokens = gym_turn(door, body, inline_ids=turn != 1)
        if earlier is not None:
            prefix = earlier["prompt_token_ids"] + earlier["generation_token_ids"]
            assert tokens["prompt_token_ids"][:len(prefix)] == prefix, f"turn {turn}"
        fetch = lambda b: gym_tokenize(door, b)  # noqa: E731
        if turn != 1:  # vLLM's inline IDs, then only the logprob entries and /tokenize
            assert gym_tokens(without_message_tokens(answer), request, fetch) == (tokens, "inline")
        bare = without_inline_ids(without_message_tokens(answer))
        read, source = gym_tokens(bare, request, fetch)
        assert source == "tokenize" and read["generation_token_ids"] == tokens[
            "generation_token_ids"] and read["prompt_token_ids"] == tokens["prompt_token_ids"]
        assert read["generation_log_probs"] == pytest.approx(tokens["generation_log_probs"])
        message = answer["choices"][0]["message"]
        call = message["tool_calls"][0]
        messages = [*messages, gym_history_message(message, tokens),
                    {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        earlier = tokens


def test_a_required_prefix_that_disagrees_with_the_messages_tokens_is_refused_by_name(door,
                                                                                     model):
    _, answer, tokens = gym_turn(door, {"model": model, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Hi"}]}, inline_ids=False)
    message = answer["choices"][0]["message"]
    messages = [{"role": "user", "content": "Hi"}, gym_history_message(message, tokens),
                {"role": "user", "content": "And?"}]
    wrong = tokens["prompt_token_ids"] + tokens["generation_token_ids"] + [5]
    refused = httpx.post(f"{door}/chat/completions", timeout=120, json=gym_request(
        {"model": model, "max_tokens": 8, "messages": messages,
         "required_prefix_token_ids": wrong}, inline_ids=False))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "required_prefix_token_ids"
    assert "messages[1]" in refused.json()["error"]["message"]
    gym_turn(door, {"model": model, "max_tokens": 8, "messages": messages}, inline_ids=True)


# Last in the module: it kills one of the fleet's two workers.
def test_a_trajectory_whose_worker_is_lost_continues_on_the_other_exactly(door, model, fleet):
    """The worker holding a trajectory is killed between its turns: the next turn goes to the
    other worker (the prefix recomputed there), its prompt still the last turn's exact tokens."""
    from tests.support.lost_worker import wait_until_lost

    messages = [{"role": "user", "content": "What is the weather?"}]
    with door_client(door, trajectory="lost-1") as client:
        first = tool_turn(client, model, messages, seed=21)
        holder = served_by(first)
        (name,) = [n for n, instance in fleet.instance_ids.items() if instance == holder]
        fleet.placement.kill(name)
        wait_until_lost(fleet, name)
        message = first.choices[0].message
        messages += [as_an_agent_sends_it(message),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                      "content": "sunny"}]
        second = tool_turn(client, model, messages, seed=22)
    earlier = first.prompt_token_ids + first.choices[0].token_ids
    assert second.prompt_token_ids[:len(earlier)] == earlier
    assert served_by(second) != holder
    assert second.choices[0].message.tool_calls  # served whole, parsed as ever

