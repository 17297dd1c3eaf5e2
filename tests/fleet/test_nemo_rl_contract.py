"""NeMo-RL's newest generation contract and NeMo-Gym's token capture, through the drop-in
``DynamoGeneration`` over a fleet of two real vLLM workers (CPU) behind the real frontend and
the fleet's door (two processes), staging into a real TransferQueue (SimpleStorage) on a local
Ray. The fleet, the door and TransferQueue start once for the module.

Restated in this project's words from their source (nothing copied):

- NeMo-RL's controller handle, ``tests/mock_stack/runtime.py`` @ 1b10162582f1
  (``GenerationHandle``: ``dp_openai_server_base_urls``, ``weight_synchronizer``,
  ``load_and_start``, ``setup_token_capture(dp_config, partition)``,
  ``set_rollout_weight_version``, the step hooks), and the controller's setup order
  (``single_controller_utils/setup.py``: the staging partition, ``setup_token_capture``, then
  ``set_rollout_weight_version(0)``, then the weight synchroniser it attaches);
- NeMo-RL's interface, ``nemo_rl/models/generation/interfaces.py`` @ 604eb06e812e (token
  capture) and its branch with the checkpoint hooks, whose controller runs pause, NeMo-Gym's
  prepare (its generation cuts), the split resume, the data plane's commit, finish; the worker
  side, ``nemo_rl/models/generation/vllm/vllm_worker_async.py`` @ 1c06b50480e6 (the sampling
  guard, a captured call staged before its answer, the cut route and its bearer);
- NeMo-Gym's capture, ``nemo_gym/token_id_capture/README.md`` @ 0edca0591d53,
  ``staging/records.py`` and ``_checkpoint/generation_cut.py`` @ 012b7b66933a,
  ``staging/digest.py`` and ``staging/capture.py`` @ 05b6ffc12747 (``ng_capture`` in,
  ``ng_commit_coords`` out, token fields stripped, a staging chain resolved link by link, the
  cut inventory and its receipt, a restored call's ``generation_cut`` continuation).

Checked: the handle as the controller drives it (its one URL, the door's, for NeMo-Gym); two
agent trajectories of three turns each, interleaved (a text root, then a continuation whose
prefix comes inline, read from the frontend as a stream as with cuts on, then one whose prefix
is read back from its staging chain): the rows in TransferQueue are the turns' exact prompt
and generated tokens and logprobs, the agents' answers carry only commit coordinates, and a
broken chain is a 400 naming its place; the sampling guard refuses off-policy requests by
field; the cut route answers 404 while cuts are off and 401 to a wrong bearer, and the same
inventory twice gets the same receipt; a greedy turn cut mid-generation (the cut reaching the
other door process, one of the cuts inside a checkpoint run through the drop-in's hooks, which
hold a call that finishes meanwhile until the checkpoint ends) and then resumed from its cut
stages the same row as the same turn never cut (its logprobs past the cut to float32's last
bits).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

import attrs
import httpx
import pytest

from rollout_fleet.adapters.agent_door.replies import DOOR_PROCESS_HEADER
from rollout_fleet.adapters.tiny_model.build import build_tiny_model
from rollout_fleet.core.capture_records import StagingChainBroken
from rollout_fleet.core.generation_cut import CUT_ROUTE
from rollout_fleet.wiring.door_control_client import DoorControlError
from rollout_fleet.wiring.nemo_rl import DynamoGeneration
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before

pytestmark = [pytest.mark.vllm, pytest.mark.dynamo, pytest.mark.ray]
MAX_MODEL_LEN = 512
PARTITION = "token-staging"
CUT_TOKEN = "the-cut-bearer"
VERSION = 3
GREEDY = {"temperature": 0.0, "top_p": 1.0}  # the validation profile
TRAIN = {"temperature": 1.0, "top_p": 1.0}
DP_CFG = {"enabled": True, "impl": "transfer_queue", "backend": "simple",
          "simple": {"num_storage_units": 1}}
TOKEN_FIELDS = {"prompt_token_ids", "generation_token_ids", "generation_log_probs", "token_ids"}


def generation_config(model: str) -> dict:
    """``policy.generation`` as NeMo-RL writes it for its Dynamo backend with NeMo-Gym (two
    sampling profiles), plus the fleet's own section (two workers on this machine, beside the
    Ray that runs TransferQueue; two door processes)."""
    return {
        "backend": "dynamo", "model_name": model, "max_new_tokens": 8, "top_k": None,
        **TRAIN, "val_temperature": GREEDY["temperature"], "val_top_p": GREEDY["top_p"],
        "stop_strings": None, "stop_token_ids": None, "_pad_token_id": 0,
        "dynamo_cfg": {"engine": "vllm", "startup_timeout_s": 400, "request_timeout_s": 120,
                       "control_timeout_s": 120, "worker_args": {},
                       "frontend_args": {"router_mode": "round-robin"}},
        "vllm_cfg": {"async_engine": True, "tensor_parallel_size": 1,
                     "pipeline_parallel_size": 1, "expert_parallel_size": 1,
                     "precision": "float32", "max_model_len": MAX_MODEL_LEN,
                     "kv_cache_dtype": "auto", "enforce_eager": True,
                     "expose_http_server": True, "enable_vllm_metrics_logger": False},
        "vllm_kwargs": {}, "colocated": {"enabled": False},
        "rollout_fleet": {"placement": "local", "num_workers": 2, "door": {"processes": 2}},
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import ray

    from rollout_fleet.adapters.transfer_queue import (
        TransferQueueStaging, start_transfer_queue, stop_transfer_queue,
    )

    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    generation = None
    groups: list[int] = []
    ports: list[int] = []
    try:
        start_transfer_queue(storage_units=1)
        model = build_tiny_model(tmp_path_factory.mktemp("contract-model"))
        before = own_children_before()
        config = generation_config(str(model))
        DynamoGeneration.validate_settings({"policy": {"generation": config}})
        generation = DynamoGeneration(None, config)
        groups, ports = generation._fleet.process_groups(), fleet_ports(generation._fleet)
        yield generation, TransferQueueStaging(PARTITION)
    finally:
        if generation is not None:
            assert generation.shutdown() is True
        stop_transfer_queue()
        ray.shutdown()
    assert_nothing_left(groups, ports, before)


def door_url(generation) -> str:
    """NeMo-Gym's base URL is the handle's first OpenAI server, without its ``/v1``."""
    return generation.dp_openai_server_base_urls[0].removesuffix("/v1")


def set_up(generation, *, cuts: bool) -> None:
    """As NeMo-RL's controller: the capture setup, then the rollout weight version."""
    generation.setup_token_capture(DP_CFG, PARTITION, generation_prefix_cuts_enabled=cuts,
                                   generation_cut_control_token=CUT_TOKEN if cuts else None)
    generation.set_rollout_weight_version(VERSION)


def chat(url, messages, ng_capture=None, model=None, **extra):
    body = {"model": model, "messages": messages, "max_tokens": 8, **GREEDY, **extra}
    if ng_capture is not None:
        body["ng_capture"] = ng_capture
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def admission(rollout, call, parent=None, prefix=(), chain=()):
    """Gym's ng_capture: a text root, or a continuation of ``parent`` (its coordinates)."""
    if parent is None:
        return {"rollout_id": rollout, "model_call_id": call, "mode": "text"}
    return {"rollout_id": rollout, "model_call_id": call, "mode": "token_in",
            "parent_call_id": parent["model_call_id"], "prev_len": parent["cum_len"],
            "parent_chain_hash": parent["chain_hash"],
            "required_prefix_token_ids": list(prefix), "staging_chain": list(chain)}


def assert_token_free(answer):
    assert answer["id"]
    assert not TOKEN_FIELDS & set(answer), answer
    (choice,) = answer["choices"]
    assert "logprobs" not in choice and not TOKEN_FIELDS & set(choice)
    assert not TOKEN_FIELDS & set(choice["message"]) and "nvext" not in answer


def test_the_handle_as_nemo_rls_controller_drives_it(stack):
    generation, _staging = stack
    generation.load_and_start()
    set_up(generation, cuts=False)
    (base,) = generation.dp_openai_server_base_urls
    assert base == generation.frontend_url == f"{generation._fleet.door_url}/v1"
    assert generation.weight_synchronizer is None  # NeMo-RL's setup attaches its own
    generation.weight_synchronizer = synchronizer = object()
    assert generation.weight_synchronizer is synchronizer
    generation.weight_synchronizer = None
    assert (generation.blocks_training(), generation.wake_carries_weight_updates()) == \
        (False, False)
    assert generation.prepare_for_generation() is True
    generation.snapshot_step_metrics()
    assert generation.get_step_metrics() == {"retried_attempts": 0.0}
    assert isinstance(generation.drain_latest_logger_metrics(), dict)
    assert generation.invalidate_kv_cache() is True
    assert generation.finish_generation() is True
    status = generation.hooks.controls().token_capture_status()
    assert (status["staging_partition"], status["weight_version"]) == (PARTITION, VERSION)
    assert status["sampling"] == {**TRAIN, "val_temperature": 0.0, "val_top_p": 1.0}


def test_two_interleaved_trajectories_commit_their_exact_turns(stack):
    generation, staging = stack
    url, model = door_url(generation), generation.cfg["model_name"]
    talks = {name: [{"role": "user", "content": f"Weather in {city}?"}]
             for name, city in (("traj-a", "Paris"), ("traj-b", "Oslo"))}
    coords: dict[str, list[dict]] = {name: [] for name in talks}
    for turn in range(3):
        set_up(generation, cuts=turn == 1)  # the door reads the turn whole, or as a stream
        for name, messages in talks.items():
            earlier = coords[name]
            keys = [c["staging_key"] for c in earlier]
            prefix = staging.prefix(keys) if earlier else []
            capture = admission(name, f"call-{turn}", earlier[-1] if earlier else None,
                                prefix=prefix if turn == 1 else (),
                                chain=keys if turn == 2 else ())
            answered = chat(url, messages, capture, model)
            assert answered.status_code == 200, answered.text
            answer = answered.json()
            assert_token_free(answer)
            committed = answer["ng_commit_coords"]
            assert committed["disposition"] == "staged" and committed["weight_version"] == VERSION
            assert committed["prev_len"] == len(prefix)
            extra = {"required_prefix_token_ids": list(prefix)} if prefix else {}
            reference = chat(url, messages, None, model, return_token_ids=True, logprobs=True,
                             **extra)  # the same turn uncaptured
            assert reference.status_code == 200, reference.text
            expected = reference.json()["choices"][0]["message"]
            (row,) = staging.rows([committed["staging_key"]])
            generated = [t for t, m in zip(row.token_ids_delta, row.token_mask_delta) if m]
            assert list(row.token_ids_delta) == \
                expected["prompt_token_ids"][len(prefix):] + expected["generation_token_ids"]
            assert generated == expected["generation_token_ids"]
            assert [lp for lp, m in zip(row.generation_logprobs_delta, row.token_mask_delta)
                    if m] == pytest.approx(expected["generation_log_probs"], abs=1e-4)
            assert (row.digest, row.chain_hash) == (committed["digest"], committed["chain_hash"])
            earlier.append(committed)
            messages += [{"role": "assistant", "content": answer["choices"][0]["message"]
                          ["content"]}, {"role": "user", "content": f"And turn {turn + 2}?"}]
    a = coords["traj-a"]
    broken = chat(url, talks["traj-a"][:1], admission(
        "traj-a", "call-x", a[1], chain=[a[0]["staging_key"], "traj-a/never-staged"]), model)
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "staging_chain[1]"
    skipped = chat(url, talks["traj-a"][:1], admission(
        "traj-a", "call-y", a[2], chain=[a[0]["staging_key"], a[2]["staging_key"]]), model)
    assert skipped.status_code == 400 and skipped.json()["error"]["param"] == "staging_chain[1]"
    streamed = chat(url, talks["traj-b"][:1], admission("traj-b", "s"), model, stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_the_sampling_guard_refuses_off_policy_requests_by_field(stack):
    generation, _staging = stack
    url, model = door_url(generation), generation.cfg["model_name"]
    set_up(generation, cuts=False)
    hello = [{"role": "user", "content": "Hello"}]
    for refused, field in (({"top_k": 5}, "top_k"), ({"top_p": None}, "top_p"),
                           ({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p")):
        answer = chat(url, hello, admission("guard", "g"), model, **refused)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == field, error
        if field != "top_k":
            assert "train (temperature=1, top_p=1), validation (temperature=0, top_p=1)" in \
                error["message"]
        assert chat(url, hello, None, model, **refused).status_code == 400  # uncaptured too
    assert chat(url, hello, None, model, top_k=-1, **TRAIN).status_code == 200


def inventory(checkpoint, calls):
    prefixes = sorted(({"ticket_id": f"ticket-{call}", "rollout_id": rollout, "attempt": 0,
                        "model_call_id": call, "admitted_at": 1.5} for rollout, call in calls),
                      key=lambda prefix: prefix["ticket_id"])
    payload = {"checkpoint_id": checkpoint, "server_name": "policy", "active_prefixes": prefixes}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"))
                            .encode()).hexdigest()
    return {**payload, "inventory_digest": digest}


def cut(client, body, token=CUT_TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return client.post(CUT_ROUTE, json=body, headers=headers)


def test_the_cut_route_is_404_while_off_401_to_a_wrong_bearer_and_replays_its_receipt(stack):
    generation, _staging = stack
    url = door_url(generation)
    body = inventory("ckpt-route", [("nobody", "not-in-flight")])
    with httpx.Client(base_url=url, timeout=60) as client:
        set_up(generation, cuts=False)
        assert cut(client, body).status_code == 404
        set_up(generation, cuts=True)
        assert cut(client, body, token="wrong").status_code == 401
        assert cut(client, body, token=None).status_code == 401
        assert cut(client, {"checkpoint_id": "x"}).status_code == 400
        first = cut(client, body)
        assert first.status_code == 200, first.text
        receipt = first.json()
        assert receipt["inventory"] == body and receipt["prefixes"][0]["disposition"] == \
            "durable_failure"
    with httpx.Client(base_url=url, timeout=60) as other:  # any process: the same
        assert cut(other, body).json() == receipt
    with pytest.raises(DoorControlError) as refused:
        generation.set_rollout_weight_version(-1)
    assert (refused.value.status, refused.value.param) == (400, "version")
    wrong_secret = httpx.post(f"{url}/door/control/set_rollout_weight_version",
                              json={"version": 1, "control_secret": "wrong"})
    assert wrong_secret.status_code == 401


def staged(staging, key) -> bool:
    try:
        return bool(staging.rows([key]))
    except StagingChainBroken:
        return False


def pid_of(client) -> int:
    return int(client.get("/health").headers[DOOR_PROCESS_HEADER])


def other_process_client(url, held_by):
    """A client of the door process that does not hold the call (where the door has two)."""
    for _ in range(64):
        client = httpx.Client(base_url=url, timeout=60)
        if pid_of(client) != held_by:
            return client
        client.close()
    return httpx.Client(base_url=url, timeout=60)


def checkpoint_round(generation, url, cutter, staging, model, messages):
    """One checkpoint as NeMo-RL's controller runs it, through the drop-in's hooks: pause,
    NeMo-Gym's cut of the call, the split resume, then finish. A short call admitted while
    paused is forwarded after the split resume but answered, and staged, only at the end."""
    assert generation.pause_generation_for_checkpoint(timeout_s=30) is True
    short = []
    thread = threading.Thread(target=lambda: short.append(chat(
        url, messages, admission("fenced", "short-0"), model, max_tokens=2)))
    thread.start()
    receipt = cut(cutter, inventory("ckpt-hooks", [("resume", "call-0")])).json()
    assert generation.resume_generation_after_cut(timeout_s=30) is True
    time.sleep(1.0)
    assert not short and not staged(staging, "fenced/short-0")  # no row, so no answer, yet
    assert generation.finish_generation_checkpoint(timeout_s=30) is True
    thread.join(60)
    assert short[0].status_code == 200 and staged(staging, "fenced/short-0")
    assert generation.resume_generation_after_checkpoint() is True  # harmless after a finish
    return receipt


def test_a_greedy_turn_cut_mid_generation_and_resumed_stages_the_uncut_row(stack):
    generation, staging = stack
    url, model = door_url(generation), generation.cfg["model_name"]
    set_up(generation, cuts=True)
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    capture = admission("resume", "call-0")
    long = {"max_tokens": 240, "ignore_eos": True}
    uncut = chat(url, messages, capture, model, **long)
    assert uncut.status_code == 200, uncut.text
    (uncut_row,) = staging.rows([uncut.json()["ng_commit_coords"]["staging_key"]])
    holder = httpx.Client(base_url=url, timeout=120)
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(holder.post(
        "/v1/chat/completions", json={"model": model, "messages": messages, **GREEDY, **long,
                                      "ng_capture": capture})))
    cutter = other_process_client(url, pid_of(holder))
    thread.start()
    acks, attempt, hooked = [], 0, False
    while thread.is_alive():  # a cut every 50 ms while the call decodes: chunk after chunk
        attempt += 1
        if acks and not hooked:  # once a cut landed, one inside a checkpoint's hooks
            receipt, hooked = checkpoint_round(generation, url, cutter, staging, model,
                                               messages), True
        else:
            receipt = cut(cutter, inventory(f"ckpt-{attempt}", [("resume", "call-0")])).json()
        (acked,) = receipt["prefixes"]
        if acked["disposition"] == "durable_prefix":
            acks.append(acked)
        time.sleep(0.05)
    thread.join(timeout=120)
    holder.close()
    cutter.close()
    assert hooked and len(acks) >= 2, f"{len(acks)} cuts reached the call while it decoded"
    ack = acks[-1]
    assert len(ack["staging_keys"]) == len({tuple(a["staging_keys"]) for a in acks})
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert 0 < ack["prefix_token_count"] < long["max_tokens"]
    (cut_row,) = staging.rows(["resume/call-0"])
    assert cut_row == uncut_row  # decoding went on unchanged past the cuts
    continuation = {name: ack[name] for name in ("staging_keys", "prefix_token_count",
                                                 "prefix_digest", "effective_output_limit")}
    resumed = chat(url, messages, {**capture, "generation_cut": {
        **continuation, "source_capture_key": "resume", "source_model_call_id": "call-0"}},
        model, **long)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["choices"][0]["message"]["content"] == \
        uncut.json()["choices"][0]["message"]["content"]
    (resumed_row,) = staging.rows(["resume/call-0"])
    # The same row: tokens, mask, lineage, chain and cumulative hashes; the logprobs decoded
    # after the restored prefix equal the uncut ones to float32's last bit or two (the engine
    # computed the prefix's keys and values in a prefill, not step by step), and the digest,
    # which hashes them, with them.
    assert resumed_row.generation_logprobs_delta == pytest.approx(
        uncut_row.generation_logprobs_delta, abs=1e-5)
    assert attrs.evolve(resumed_row, generation_logprobs_delta=uncut_row.generation_logprobs_delta,
                        digest=uncut_row.digest) == uncut_row
    restored = len(uncut_row.token_ids_delta) - long["max_tokens"] + ack["prefix_token_count"]
    assert resumed_row.generation_logprobs_delta[:restored] == \
        uncut_row.generation_logprobs_delta[:restored]  # the restored prefix's: as staged
    committed = resumed.json()["ng_commit_coords"]
    assert {**committed, "digest": None} == {**uncut.json()["ng_commit_coords"], "digest": None}
