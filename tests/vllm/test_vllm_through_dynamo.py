"""A rollout through the real Dynamo frontend to a vLLM worker equals the direct ``serve_rollout``.

The worker is a real ``rollout_fleet.wiring.worker`` process of engine kind ``vllm`` serving the
same tiny model as the session's engine, which gives the direct answers (same weights, same
engine settings: greedy and seeded sampling are reproducible across vLLM instances).
"""

from __future__ import annotations

import json
import time

import attrs
import httpx
import pytest

from rollout_fleet.adapters.tiny_model import TinyModelSpec
from rollout_fleet.core.rollout import FinishReason, RolloutRequest, SamplingSpec
from rollout_fleet.core.wire import completion_body, parse_completion_answer

from .conftest import CONTROL_SECRET, EOS_TOKEN_ID, SERVED_MODEL, VllmFleet

TINY_CONTEXT = TinyModelSpec().max_position_embeddings  # the fleet's model's context


def through_frontend(fleet: VllmFleet, request: RolloutRequest):
    answer = httpx.post(f"{fleet.url()}/v1/completions", json=completion_body(request, SERVED_MODEL),
                        timeout=120)
    assert answer.status_code == 200, answer.text
    return parse_completion_answer(answer.content)


def direct(vllm_engine, request: RolloutRequest):
    return vllm_engine.serve(request.prompt_token_ids, request.max_new_tokens, request.sampling,
                             request.stop_strings, request_id=request.request_id)


def assert_same(served, expected):
    assert served.token_ids == expected.token_ids
    assert served.logprobs == expected.logprobs  # exact: JSON carries floats losslessly
    assert served.finish_reason == expected.finish_reason


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_rollout_through_frontend_equals_direct(vllm_fleet, vllm_engine, greedy):
    prompts = vllm_engine.prompts
    for index, prompt in enumerate(prompts[:3]):
        request = RolloutRequest(request_id=f"fe-{greedy}-{index}", prompt_token_ids=prompt,
                                 max_new_tokens=24,
                                 sampling=SamplingSpec(greedy=greedy, temperature=0.8, seed=index))
        assert_same(through_frontend(vllm_fleet, request), direct(vllm_engine, request))


def test_stop_string_through_frontend_equals_direct(vllm_fleet, vllm_engine, decode):
    prompt = vllm_engine.prompts[1]
    free = direct(vllm_engine, RolloutRequest(request_id="fe-free", prompt_token_ids=prompt,
                                              max_new_tokens=24))
    stop = decode(free.token_ids[:6])[-2:]
    request = RolloutRequest(request_id="fe-stop", prompt_token_ids=prompt, max_new_tokens=24,
                             stop_strings=(stop,))
    expected = direct(vllm_engine, request)
    assert expected.finish_reason is FinishReason.STOP
    assert_same(through_frontend(vllm_fleet, request), expected)


def test_rollout_ending_in_eos_keeps_every_token_through_frontend(vllm_fleet, vllm_engine):
    """The frontend ends a stream at EOS; the rollout's one final chunk must still arrive whole."""
    prompt = vllm_engine.prompts[0]
    for seed in range(300):
        request = RolloutRequest(request_id=f"fe-eos-{seed}", prompt_token_ids=prompt,
                                 max_new_tokens=48, sampling=SamplingSpec(greedy=False, seed=seed))
        expected = direct(vllm_engine, request)
        if expected.token_ids[-1] == EOS_TOKEN_ID:
            break
    else:
        pytest.fail("no seed in 300 sampled an EOS within 48 tokens")
    assert expected.finish_reason is FinishReason.STOP
    assert_same(through_frontend(vllm_fleet, request), expected)


# -- plain OpenAI clients: raw httpx and JSON, no project code on the request's path ----------

def post_json(fleet: VllmFleet, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{fleet.url()}{path}", json={"model": SERVED_MODEL, **body}, timeout=120)


def shown_tokens(served) -> list[int]:
    """The tokens an OpenAI answer shows: the frontend hides the end-of-sequence token."""
    return [t for t in served.token_ids if t != EOS_TOKEN_ID]


def shown_logprobs(served) -> list[float]:
    return [lp for t, lp in zip(served.token_ids, served.logprobs) if t != EOS_TOKEN_ID]


def direct_plain(vllm_engine, prompt, max_new_tokens, sampling=SamplingSpec(), **keywords):
    return vllm_engine.loop.run(vllm_engine.engine.serve_rollout(
        list(prompt), request_id=vllm_engine.next_id(), max_new_tokens=max_new_tokens,
        sampling=sampling, **keywords))


def test_completions_logprobs_are_the_engines_own(vllm_fleet, vllm_engine, decode):
    prompt = vllm_engine.prompts[2]
    expected = direct_plain(vllm_engine, prompt, 12, top_logprobs=3)
    answer = post_json(vllm_fleet, "/v1/completions", {
        "prompt": list(prompt), "max_tokens": 12, "temperature": 0, "logprobs": 3,
        "nvext": {"extra_fields": ["completion_token_ids"]}})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    choice = body["choices"][0]
    assert len(body["choices"]) == 1
    assert body["nvext"]["completion_token_ids"] == shown_tokens(expected)
    logprobs = choice["logprobs"]
    # token_logprobs travel as 32-bit floats; the alternatives keep every bit.
    assert logprobs["token_logprobs"] == pytest.approx(shown_logprobs(expected), rel=1e-6)
    assert logprobs["tokens"] == [decode([t]) for t in shown_tokens(expected)]
    assert len(logprobs["top_logprobs"]) == len(shown_tokens(expected))
    for alternatives, top in zip(logprobs["top_logprobs"], expected.top_logprobs):
        assert alternatives == {decode([t]): lp for t, lp in top}  # greedy: the chosen is among them
    assert choice["finish_reason"] == expected.finish_reason.value


def test_streamed_completions_carry_each_tokens_logprobs(vllm_fleet, vllm_engine, decode):
    prompt = vllm_engine.prompts[3]
    expected = direct_plain(vllm_engine, prompt, 10, top_logprobs=2)
    with httpx.stream("POST", f"{vllm_fleet.url()}/v1/completions", timeout=120, json={
            "model": SERVED_MODEL, "prompt": list(prompt), "max_tokens": 10, "temperature": 0,
            "logprobs": 2, "stream": True}) as answer:
        assert answer.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in answer.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c for event in events for c in event["choices"]]
    # A chunk per engine step: one token each, or several when the engine ran ahead.
    token_logprobs = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    tops = [top for c in choices for top in c["logprobs"]["top_logprobs"]]
    assert token_logprobs == pytest.approx(shown_logprobs(expected), rel=1e-6)
    assert tops == [{decode([t]): lp for t, lp in top} for top in expected.top_logprobs[:len(tops)]]
    assert choices[-1]["finish_reason"] == expected.finish_reason.value


def test_chat_logprobs_are_the_engines_own(vllm_fleet, vllm_engine, tokenizer):
    content = "the cat sat on"
    # The tiny model's chat template: each message's text, then EOS.
    prompt = tokenizer.encode(content + "</s>").ids
    expected = direct_plain(vllm_engine, prompt, 8, top_logprobs=2)
    answer = post_json(vllm_fleet, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
        "logprobs": True, "top_logprobs": 2})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    entries = body["choices"][0]["logprobs"]["content"]
    assert [e["token_id"] for e in entries] == shown_tokens(expected)
    assert [e["logprob"] for e in entries] == pytest.approx(shown_logprobs(expected), rel=1e-6)
    for entry, top in zip(entries, expected.top_logprobs):
        assert [a["logprob"] for a in entry["top_logprobs"]][:2] == pytest.approx(
            [lp for _, lp in top], rel=1e-6)


def test_seeded_plain_completion_equals_the_engines_seeded_sample(vllm_fleet, vllm_engine):
    prompt = vllm_engine.prompts[4]
    sampling = SamplingSpec(greedy=False, temperature=0.8, seed=11)
    expected = direct_plain(vllm_engine, prompt, 16, sampling)
    for _ in range(2):  # and again: the seed makes it repeatable
        answer = post_json(vllm_fleet, "/v1/completions", {
            "prompt": list(prompt), "max_tokens": 16, "temperature": 0.8, "seed": 11,
            "logprobs": 0, "nvext": {"extra_fields": ["completion_token_ids"]}})
        assert answer.status_code == 200, answer.text
        assert answer.json()["nvext"]["completion_token_ids"] == shown_tokens(expected)


def test_stop_token_ids_end_the_completion_at_that_token(vllm_fleet, vllm_engine):
    prompt = vllm_engine.prompts[2]
    free = direct_plain(vllm_engine, prompt, 12)
    stop_at = free.token_ids[3]
    answer = post_json(vllm_fleet, "/v1/completions", {
        "prompt": list(prompt), "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at],
        "nvext": {"extra_fields": ["completion_token_ids"]}})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    end = free.token_ids.index(stop_at) + 1
    # The stop token is kept in the token IDs (its text is not shown), as vLLM keeps it.
    assert body["nvext"]["completion_token_ids"] == list(free.token_ids[:end])
    assert body["usage"]["completion_tokens"] == end


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"prompt": [5, 6, 7]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
], ids=["completions", "chat"])
def test_two_choices_are_refused_with_a_400_that_says_so(vllm_fleet, path, extra):
    answer = post_json(vllm_fleet, path, {"max_tokens": 4, "n": 2, **extra})
    assert answer.status_code == 400, answer.text
    assert "n=2" in answer.json()["message"] and "one choice per request" in answer.json()["message"]


def test_nemo_rl_direct_driver_request_gets_what_it_reads(vllm_fleet, vllm_engine):
    """The body NeMo-RL's upstream Dynamo driver builds for a rollout (token IDs, n=1,
    logprobs=0, nvext completion_token_ids), and the fields it reads back."""
    for greedy, prompt in ((True, vllm_engine.prompts[0]), (False, vllm_engine.prompts[5])):
        sampling = SamplingSpec() if greedy else SamplingSpec(greedy=False, temperature=1.0, seed=3)
        expected = direct_plain(vllm_engine, prompt, 20, sampling)
        body = {"prompt": list(prompt), "max_tokens": 20, "temperature": 0.0 if greedy else 1.0,
                "top_p": 1.0, "top_k": 1 if greedy else -1, "n": 1, "logprobs": 0,
                "include_stop_str_in_output": True,
                "nvext": {"extra_fields": ["completion_token_ids"]}}
        if not greedy:
            body["seed"] = 3
        answer = post_json(vllm_fleet, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        response = answer.json()
        choice = response["choices"][0]
        token_ids = [int(t) for t in response["nvext"]["completion_token_ids"]]
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert token_ids == shown_tokens(expected)
        assert len(token_logprobs) == len(token_ids)
        assert all(isinstance(lp, float) for lp in token_logprobs)
        assert token_logprobs == pytest.approx(shown_logprobs(expected), rel=1e-6)
        truncated = choice["finish_reason"] == "length"
        assert truncated == (expected.finish_reason is FinishReason.LENGTH)


def test_a_rollout_cut_mid_way_and_continued_equals_the_uncut_greedy_rollout(vllm_fleet, vllm_engine):
    """The driver aborts a rollout through the workers' control channel, gets the tokens so far
    (finish reason abort), continues it with the budget left, and the join is the uncut rollout."""
    import asyncio

    from rollout_fleet.adapters.http import HttpCompletionsTransport, HttpWorkerControl
    from rollout_fleet.core.partial import abort_everywhere
    from rollout_fleet.core.rollout_client import RolloutClient

    # The whole context's budget, past end-of-sequence: the longest rollout the tiny model can
    # run, so a cut has the most room to land mid-way however loaded the machine is.
    prompt = vllm_engine.prompts[0]
    uncut = RolloutRequest(request_id="fe-whole", prompt_token_ids=prompt, ignore_eos=True,
                           max_new_tokens=TINY_CONTEXT - len(prompt))
    started = time.monotonic()
    whole = through_frontend(vllm_fleet, uncut)
    whole_s = time.monotonic() - started
    assert len(whole.token_ids) == uncut.max_new_tokens
    control = HttpWorkerControl("w0", f"http://127.0.0.1:{_system_port(vllm_fleet)}",
                                secret=CONTROL_SECRET)

    async def held_by_the_worker(rollout) -> None:
        """Once the worker reports the rollout in flight (or it ended first)."""
        while not rollout.done():
            if (await control.call("stats", {}, timeout_s=30))["in_flight"]:
                return
            await asyncio.sleep(0.001)

    async def cut_then_continue(client, request, delay_s):
        rollout = asyncio.ensure_future(client.rollout(request))
        # The delay counts from the rollout's arrival at the worker, not from its sending: on a
        # loaded machine the way through the frontend took longer than the search's steps.
        await held_by_the_worker(rollout)
        await asyncio.sleep(delay_s)
        asked = time.monotonic()
        holders = await abort_everywhere([control], request.request_id)
        abort_s = time.monotonic() - asked
        partial = await rollout
        landed = ("late" if partial.finish_reason is not FinishReason.ABORT
                  else "early" if not partial.token_ids else "mid-way")
        seen = (f"{landed} at {delay_s * 1000:.1f} ms ({len(partial.token_ids)} tokens, the abort"
                f" answered in {abort_s * 1000:.0f} ms, held by {holders})")
        if landed != "mid-way":
            return landed, seen, None
        return landed, seen, (holders, partial, await client.continue_rollout(request, partial))

    async def search():
        """How long the rollout takes depends on the machine's load: search the delay between
        one that cut before the first token and one that came after the end, until a cut lands
        mid-way. Every attempt runs on one loop whose connections to the frontend and to the
        control channel are open before the first: a new connection's first send once stalled
        a loaded machine's loop ~0.8 s, past the rollout's end."""
        client = RolloutClient(HttpCompletionsTransport(vllm_fleet.url()), model=SERVED_MODEL)
        await control.call("stats", {}, timeout_s=30)
        await client.rollout(attrs.evolve(uncut, request_id="fe-cut-warm", max_new_tokens=1))
        early_s, late_s, delay_s, misses = 0.0, None, whole_s / 4, []
        for attempt in range(20):
            request = attrs.evolve(uncut, request_id=f"fe-cut-{attempt}")
            landed, seen, outcome = await cut_then_continue(client, request, delay_s)
            if outcome is not None:
                return outcome, [*misses, seen]
            misses.append(seen)
            early_s, late_s = (delay_s, late_s) if landed == "early" else (early_s, delay_s)
            delay_s = (early_s + late_s) / 2 if late_s is not None else max(2 * delay_s, 0.01)
        pytest.fail(f"no abort landed mid-way (the uncut rollout took {whole_s * 1000:.0f} ms): "
                    + ", ".join(misses))

    outcome, cuts = asyncio.run(search())
    print(f"the uncut rollout took {whole_s * 1000:.0f} ms; cuts: {', '.join(cuts)}")
    holders, partial, joined = outcome
    assert holders == ["w0"]
    assert 0 < len(partial.token_ids) < len(whole.token_ids)
    assert partial.weight_versions == ((0, len(partial.token_ids)),)
    assert joined.token_ids == whole.token_ids
    assert joined.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert joined.finish_reason is whole.finish_reason
    assert joined.weight_versions == ((0, len(whole.token_ids)),)


def _system_port(fleet: VllmFleet) -> int:
    return json.loads((fleet.run_dir / "worker.json").read_text())["system_port"]


def test_sleep_is_refused_on_the_cpu_naming_the_platform_and_the_worker_still_serves(
        vllm_fleet, vllm_engine):
    """vLLM has no sleep mode on the CPU: the real worker's sleep control says so (nothing is
    faked), stays awake, and serves the next rollout as before."""
    request = RolloutRequest(request_id="fe-sleep-cpu", prompt_token_ids=vllm_engine.prompts[0],
                             max_new_tokens=12)
    url = f"http://127.0.0.1:{_system_port(vllm_fleet)}/engine/control"
    vllm_fleet.url()  # the worker is up
    secret = {"control_secret": CONTROL_SECRET}
    refused = httpx.post(f"{url}/sleep", json={"level": 1, **secret}, timeout=60).json()
    assert refused["status"] == "error", refused
    assert "no sleep mode on the cpu platform" in refused["message"], refused
    state = httpx.post(f"{url}/is_sleeping", json=secret, timeout=60).json()
    assert state["status"] == "ok" and not state["sleeping"] and state["serving"], state
    assert_same(through_frontend(vllm_fleet, request), direct(vllm_engine, request))


def test_a_group_is_one_request_answered_with_each_samples_own_seed(vllm_fleet, vllm_engine):
    import asyncio

    from rollout_fleet.adapters.http import HttpCompletionsTransport
    from rollout_fleet.core.rollout import sample_sampling
    from rollout_fleet.core.rollout_client import RolloutClient

    prompt, seeded = vllm_engine.prompts[0], SamplingSpec(greedy=False, temperature=0.8, seed=11)

    async def groups():  # through the driver's own client and transport
        transport = HttpCompletionsTransport(vllm_fleet.url())
        client = RolloutClient(transport, model=SERVED_MODEL)
        try:
            return (await client.rollout_group(RolloutRequest("grp-s", prompt, 16, sampling=seeded, n=4)),
                    await client.rollout_group(RolloutRequest("grp-g", prompt, 16, n=4)))
        finally:
            await transport.aclose()

    sampled, greedy = asyncio.run(groups())
    alone = [direct(vllm_engine, RolloutRequest(f"alone-{i}", prompt, 16,
                                                sampling=sample_sampling(seeded, i)))
             for i in range(4)]
    assert [r.request_id for r in sampled] == [f"grp-s/{i}" for i in range(4)]
    assert [r.token_ids for r in sampled] == [a.token_ids for a in alone]
    assert all(r.logprobs == pytest.approx(a.logprobs, abs=1e-3) for r, a in zip(sampled, alone))
    assert len({r.token_ids for r in sampled}) > 1
    assert all(sum(count for _, count in r.weight_versions) == len(r.token_ids) for r in sampled)
    greedy_alone = direct(vllm_engine, RolloutRequest("alone-g", prompt, 16))
    assert [r.token_ids for r in greedy] == [greedy_alone.token_ids] * 4


def test_a_bad_group_size_is_a_400_naming_n_and_the_worker_serves_on(vllm_fleet, vllm_engine):
    request = RolloutRequest("grp-bad", vllm_engine.prompts[0], 4, n=2)
    body = completion_body(request, SERVED_MODEL)
    body["nvext"]["annotations"] = [body["nvext"]["annotations"][0].replace('"n":2', '"n":0')]
    answer = post_json(vllm_fleet, "/v1/completions", body)
    assert answer.status_code == 400 and "n=0" in answer.text, answer.text
    assert len(through_frontend(vllm_fleet, attrs.evolve(request, n=1)).token_ids) == 4


def test_rollouts_without_logprobs_give_the_same_tokens_and_none(vllm_fleet, vllm_engine):
    """A trainer that recomputes logprobs asks for none: through the frontend and the worker,
    one rollout and a group come back with the engine's own tokens and no logprobs."""
    import asyncio

    from rollout_fleet.adapters.http import HttpCompletionsTransport
    from rollout_fleet.core.rollout import sample_sampling
    from rollout_fleet.core.rollout_client import RolloutClient

    prompt, seeded = vllm_engine.prompts[1], SamplingSpec(greedy=False, temperature=0.8, seed=21)

    async def bare():
        transport = HttpCompletionsTransport(vllm_fleet.url())
        client = RolloutClient(transport, model=SERVED_MODEL)
        try:
            return (await client.rollout(RolloutRequest("bare-1", prompt, 12, logprobs=False)),
                    await client.rollout_group(RolloutRequest("bare-g", prompt, 12,
                                                              sampling=seeded, n=3,
                                                              logprobs=False)))
        finally:
            await transport.aclose()

    one, group = asyncio.run(bare())
    assert one.logprobs is None and all(r.logprobs is None for r in group)
    assert one.token_ids == direct(vllm_engine, RolloutRequest("bare-d", prompt, 12)).token_ids
    alone = [direct(vllm_engine, RolloutRequest(f"bare-a{i}", prompt, 12,
                                                sampling=sample_sampling(seeded, i)))
             for i in range(3)]
    assert [r.token_ids for r in group] == [a.token_ids for a in alone]
