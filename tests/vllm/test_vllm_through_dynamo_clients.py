"""Standard clients, unmodified, against a one-worker vLLM fleet behind the real frontend.

The official ``openai`` package sends most requests; vLLM's own engine (the session's AsyncLLM,
same weights and settings as the worker's) says what the answers must be. vLLM's own benchmark
client (``vllm bench serve``) runs as shipped, completions and chat.
"""

from __future__ import annotations

import pytest

from .conftest import EOS_TOKEN_ID, MODEL_SEED, SERVED_MODEL, VllmFleet

MAX_TOKENS = 24
BENCH_PROMPTS, BENCH_OUTPUT_TOKENS = 8, 12


def openai_client(fleet: VllmFleet):
    import openai

    return openai.OpenAI(base_url=f"{fleet.url()}/v1", api_key="unused", max_retries=0, timeout=120)


def shown(token_ids) -> list[int]:
    """What an OpenAI answer shows: the frontend hides end-of-sequence tokens."""
    return [t for t in token_ids if t != EOS_TOKEN_ID]


def vllms_own(vllm_engine, prompt, **params) -> tuple[list[int], str]:
    """vLLM's own AsyncLLM on the same prompt and sampling parameters: (token IDs, finish)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    async def run():
        final = None
        sampling = SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY)
        async for output in vllm_engine.engine.runtime.engine.generate(
                {"prompt_token_ids": list(prompt)}, sampling, request_id=vllm_engine.next_id()):
            final = output
        return list(final.outputs[0].token_ids), final.outputs[0].finish_reason

    return vllm_engine.loop.run(run())


def fleet_tokens(client, prompt, **body) -> list[int]:
    answer = client.completions.create(
        model=SERVED_MODEL, prompt=list(prompt), max_tokens=body.pop("max_tokens", MAX_TOKENS),
        temperature=body.pop("temperature", 1.0), seed=body.pop("seed", None),
        extra_body={**body, "nvext": {"extra_fields": ["completion_token_ids"]}})
    return answer.model_dump()["nvext"]["completion_token_ids"]


def test_openai_client_completions_and_chat_streamed_and_not(vllm_fleet, vllm_engine, tokenizer, decode):
    client = openai_client(vllm_fleet)
    prompt = vllm_engine.prompts[2]
    expected, _ = vllms_own(vllm_engine, prompt, temperature=0.0, max_tokens=MAX_TOKENS)
    whole = client.completions.create(model=SERVED_MODEL, prompt=list(prompt),
                                      max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == decode(expected)
    pieces = client.completions.create(model=SERVED_MODEL, prompt=list(prompt), stream=True,
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == decode(expected)

    content = "the cat sat on"
    chat_prompt = tokenizer.encode(content + "</s>").ids  # the tiny model's chat template
    expected_chat, _ = vllms_own(vllm_engine, chat_prompt, temperature=0.0, max_tokens=MAX_TOKENS)
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(model=SERVED_MODEL, messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == decode(expected_chat)
    assert reply.usage.prompt_tokens == len(chat_prompt)
    deltas = client.chat.completions.create(model=SERVED_MODEL, messages=messages, stream=True,
                                            max_tokens=MAX_TOKENS, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in deltas if c.choices) == decode(expected_chat)


def a_sample_ending_early(vllm_engine) -> tuple[list[int], int, list[int]]:
    """(prompt, seed, tokens) of a seeded sample that ends at EOS well within MAX_TOKENS."""
    for prompt in vllm_engine.prompts:
        for seed in range(64):
            tokens, finish = vllms_own(vllm_engine, prompt, temperature=1.0, seed=seed,
                                       max_tokens=MAX_TOKENS)
            if finish == "stop" and len(tokens) <= MAX_TOKENS - 6:
                return prompt, seed, tokens
    pytest.fail("no seeded sample ended at EOS early")


def test_each_sampling_option_does_what_vllms_own_engine_does(vllm_fleet, vllm_engine):
    client = openai_client(vllm_fleet)
    prompt, seed, ended = a_sample_ending_early(vllm_engine)
    seeded = {"temperature": 1.0, "seed": seed}
    greedy = {"temperature": 0.0}
    cases = [  # penalties on a greedy answer (it repeats itself), the rest on the early end
        (greedy, "repetition_penalty", 2.0), (greedy, "presence_penalty", 2.0),
        (greedy, "frequency_penalty", 2.0), (seeded, "min_p", 0.5),
        (seeded, "min_tokens", len(ended) + 4), (seeded, "ignore_eos", True),
        (seeded, "allowed_token_ids", sorted(set(vllm_engine.prompts[3]))[:4]),
    ]
    for base, name, value in cases:
        baseline, _ = vllms_own(vllm_engine, prompt, max_tokens=MAX_TOKENS, **base)
        expected, _ = vllms_own(vllm_engine, prompt, max_tokens=MAX_TOKENS, **base, **{name: value})
        assert expected != baseline, f"{name}={value} changes nothing here: pick another value"
        # With ignore_eos the frontend hides no token: EOS shows where it was sampled.
        wanted = expected if name == "ignore_eos" else shown(expected)
        assert fleet_tokens(client, prompt, **base, **{name: value}) == wanted, name
    assert fleet_tokens(client, prompt, **seeded) == shown(ended)


def test_a_stream_comes_in_the_engines_pieces_not_as_one_answer(vllm_fleet, vllm_engine):
    """The worker sends each piece vLLM hands over (the adapter's own test shows a chunk leaves
    before the engine finishes): the first chunk holds a small part of the answer."""
    client = openai_client(vllm_fleet)
    stream = client.completions.create(model=SERVED_MODEL, prompt=list(vllm_engine.prompts[0]),
                                       max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    whole = "".join(c.choices[0].text for c in chunks)
    assert chunks[0].choices[0].finish_reason is None
    assert len(chunks[0].choices[0].text) < len(whole) / 4, (chunks[0].choices[0].text, len(whole))
    assert len(chunks) >= 4 and chunks[-1].choices[0].finish_reason == "length"


def test_errors_name_what_was_wrong(vllm_fleet, vllm_engine):
    import openai

    client = openai_client(vllm_fleet)
    vocab = vllm_engine.engine.runtime.engine.model_config.get_vocab_size()
    prompt = list(vllm_engine.prompts[0])
    cases = [
        ({"allowed_token_ids": [5, vocab + 7]},
         f"allowed_token_ids[1]={vocab + 7} is outside the model's vocabulary of {vocab} tokens"),
        ({"stop_token_ids": [vocab]},
         f"stop_token_ids[0]={vocab} is outside the model's vocabulary of {vocab} tokens"),
        ({"n": 2}, "n=2: this fleet answers one choice per request"),
    ]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=4,
                                      extra_body=extra)
        assert message in refused.value.response.json()["message"], extra
    # A prompt token outside the vocabulary: the frontend refuses it before any worker sees
    # it, with a bare message (Dynamo 1.6.1); the fleet serves on.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=SERVED_MODEL, prompt=[5, vocab + 1], max_tokens=4)
    assert refused.value.response.json()["message"] == "Invalid request"
    assert client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=4).choices


@pytest.mark.parametrize("backend, endpoint", [("openai", "/v1/completions"),
                                               ("openai-chat", "/v1/chat/completions")])
def test_vllms_own_benchmark_client_gets_every_answer(vllm_fleet, tiny_models, tmp_path,
                                                      backend, endpoint):
    """``vllm bench serve`` streams every request and sends vLLM's sampling fields (its neutral
    ``repetition_penalty``, ``ignore_eos``): each must be answered in full."""
    from support.vllm_bench_client import bench_serve_outcome, first_errors

    outcome = bench_serve_outcome(tmp_path, [
        "--backend", backend, "--base-url", vllm_fleet.url(), "--endpoint", endpoint,
        "--model", SERVED_MODEL, "--tokenizer", str(tiny_models[MODEL_SEED]),
        "--dataset-name", "random", "--random-input-len", "16",
        "--random-output-len", str(BENCH_OUTPUT_TOKENS), "--num-prompts", str(BENCH_PROMPTS),
        "--max-concurrency", "4", "--ignore-eos", "--seed", "0", "--disable-tqdm"])
    assert (outcome["completed"], outcome["failed"]) == (BENCH_PROMPTS, 0), first_errors(outcome)
    assert outcome["total_output_tokens"] == BENCH_PROMPTS * BENCH_OUTPUT_TOKENS
