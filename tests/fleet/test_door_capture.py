"""NeMo-Gym's ledger-authoritative token capture at the fleet's door: two door processes in
front of a real vLLM worker behind the real frontend, staging into a real TransferQueue
(SimpleStorage) on a local Ray, set up through the door's controls (the fleet's secret) as
NeMo-RL's driver sets up its workers. Two agent trajectories of three turns each, interleaved
(a text root, then a continuation whose prefix comes inline, read from the frontend as a stream
as with cuts on, then one whose prefix is read back from its staging chain): the rows staged
are the turns' exact prompt and generated tokens and logprobs, the agents' answers carry only
commit coordinates, and a broken chain is refused by its place. A greedy turn cut
mid-generation (the cut reaching the other door process) and then resumed from its cut stages
the same row as the same turn never cut (its logprobs past the cut to float32's last bits).
The sampling guard refuses off-policy requests by field; the cut route answers 404 while cuts
are off and 401 to a wrong bearer, and the same inventory twice gets the same receipt. The
fleet, the door and TransferQueue start once for the module."""

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
from rollout_fleet.core.generation_cut import CUT_ROUTE
from rollout_fleet.wiring.config import parse_config
from rollout_fleet.wiring.door_control_client import DoorControlError
from rollout_fleet.wiring.fleet import Fleet
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before

pytestmark = [pytest.mark.vllm, pytest.mark.dynamo, pytest.mark.ray]
MODEL = "tiny"
MAX_MODEL_LEN = 512
PARTITION = "token-staging"
CUT_TOKEN = "the-cut-bearer"
VERSION = 3
PROFILES = {"temperature": 1.0, "top_p": 1.0, "val_temperature": 0.0, "val_top_p": 1.0}
GREEDY = {"temperature": 0.0, "top_p": 1.0}  # the validation profile
TRAIN = {"temperature": 1.0, "top_p": 1.0}
DP_CFG = {"enabled": True, "impl": "transfer_queue", "backend": "simple",
          "simple": {"num_storage_units": 1}}
TOKEN_FIELDS = {"prompt_token_ids", "generation_token_ids", "generation_log_probs", "token_ids"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import ray

    from rollout_fleet.adapters.transfer_queue import (
        TransferQueueStaging, start_transfer_queue, stop_transfer_queue,
    )

    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    fleet = None
    try:
        start_transfer_queue(storage_units=1)
        model = build_tiny_model(tmp_path_factory.mktemp("capture-model"))
        before = own_children_before()
        fleet = Fleet.start(parse_config({
            "model": str(model), "served_model_name": MODEL, "placement": "local",
            "num_workers": 1, "max_model_len": MAX_MODEL_LEN,
            "engine": {"kind": "vllm", "dtype": "float32", "enforce_eager": True,
                       "extra_engine_args": {"logprobs_mode": "processed_logprobs"}},
            "run_dir": str(tmp_path_factory.mktemp("capture-fleet") / "run"),
            "door": {"processes": 2}, "timeouts": {"start_s": 400}}))
        door = fleet.door
        yield fleet, door, TransferQueueStaging(PARTITION)
    finally:
        groups = fleet.process_groups() if fleet else []  # the door's processes too
        ports = fleet_ports(fleet) if fleet else []
        if fleet is not None:
            fleet.shutdown()
        stop_transfer_queue()
        ray.shutdown()
    assert_nothing_left(groups, ports, before)


def set_up(door, *, cuts: bool) -> None:
    controls = door.controls()
    controls.setup_token_capture(DP_CFG, PARTITION, generation_prefix_cuts_enabled=cuts,
                                 generation_cut_control_token=CUT_TOKEN if cuts else None,
                                 sampling=PROFILES)
    controls.set_rollout_weight_version(VERSION)


def chat(url, messages, ng_capture=None, **extra):
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **GREEDY, **extra}
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


def reference(url, messages, prefix):
    """The same turn uncaptured, greedy: its exact prompt, generated IDs and logprobs."""
    extra = {"required_prefix_token_ids": list(prefix)} if prefix else {}
    answer = chat(url, messages, return_token_ids=True, logprobs=True, **extra)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]


def assert_token_free(answer):
    assert answer["id"]
    assert not TOKEN_FIELDS & set(answer), answer
    (choice,) = answer["choices"]
    assert "logprobs" not in choice and not TOKEN_FIELDS & set(choice)
    assert not TOKEN_FIELDS & set(choice["message"]) and "nvext" not in answer


def test_two_interleaved_trajectories_stage_their_exact_turns(stack):
    _fleet, door, staging = stack
    talks = {name: [{"role": "user", "content": f"Weather in {city}?"}]
             for name, city in (("traj-a", "Paris"), ("traj-b", "Oslo"))}
    coords: dict[str, list[dict]] = {name: [] for name in talks}
    for turn in range(3):
        set_up(door, cuts=turn == 1)  # the door reads the turn whole, or as a stream for cuts
        for name, messages in talks.items():
            earlier = coords[name]
            keys = [c["staging_key"] for c in earlier]
            prefix = staging.prefix(keys) if earlier else []
            capture = admission(name, f"call-{turn}", earlier[-1] if earlier else None,
                                prefix=prefix if turn == 1 else (),
                                chain=keys if turn == 2 else ())
            answered = chat(door.url, messages, capture)
            assert answered.status_code == 200, answered.text
            answer = answered.json()
            assert_token_free(answer)
            committed = answer["ng_commit_coords"]
            assert committed["disposition"] == "staged" and committed["weight_version"] == VERSION
            assert committed["prev_len"] == len(prefix)
            expected = reference(door.url, messages, prefix)
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
    broken = chat(door.url, talks["traj-a"][:1], admission(
        "traj-a", "call-x", a[1], chain=[a[0]["staging_key"], "traj-a/never-staged"]))
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "staging_chain[1]"
    skipped = chat(door.url, talks["traj-a"][:1], admission(
        "traj-a", "call-y", a[2], chain=[a[0]["staging_key"], a[2]["staging_key"]]))
    assert skipped.status_code == 400 and skipped.json()["error"]["param"] == "staging_chain[1]"
    streamed = chat(door.url, talks["traj-b"][:1], admission("traj-b", "s"), stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_the_sampling_guard_refuses_off_policy_requests_by_field(stack):
    _fleet, door, _staging = stack
    set_up(door, cuts=False)
    hello = [{"role": "user", "content": "Hello"}]
    for refused, field in (({"top_k": 5}, "top_k"), ({"top_p": None}, "top_p"),
                           ({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p")):
        answer = chat(door.url, hello, admission("guard", "g"), **refused)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == field, error
        if field != "top_k":
            assert "train (temperature=1, top_p=1), validation (temperature=0, top_p=1)" in \
                error["message"]
        assert chat(door.url, hello, **refused).status_code == 400  # uncaptured chat too
    assert chat(door.url, hello, top_k=-1, **TRAIN).status_code == 200


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
    _fleet, door, _staging = stack
    body = inventory("ckpt-route", [("nobody", "not-in-flight")])
    with httpx.Client(base_url=door.url, timeout=60) as client:
        set_up(door, cuts=False)
        assert cut(client, body).status_code == 404
        set_up(door, cuts=True)
        assert cut(client, body, token="wrong").status_code == 401
        assert cut(client, body, token=None).status_code == 401
        assert cut(client, {"checkpoint_id": "x"}).status_code == 400
        first = cut(client, body)
        assert first.status_code == 200, first.text
        receipt = first.json()
        assert receipt["inventory"] == body and receipt["prefixes"][0]["disposition"] == \
            "durable_failure"
    with httpx.Client(base_url=door.url, timeout=60) as other:  # any process: the same
        assert cut(other, body).json() == receipt
    with pytest.raises(DoorControlError) as refused:
        door.controls().set_rollout_weight_version(-1)
    assert (refused.value.status, refused.value.param) == (400, "version")
    wrong_secret = httpx.post(f"{door.url}/door/control/set_rollout_weight_version",
                              json={"version": 1, "control_secret": "wrong"})
    assert wrong_secret.status_code == 401


def pid_of(client) -> int:
    return int(client.get("/health").headers[DOOR_PROCESS_HEADER])


def test_a_greedy_turn_cut_mid_generation_and_resumed_stages_the_uncut_row(stack):
    _fleet, door, staging = stack
    set_up(door, cuts=True)
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    capture = admission("resume", "call-0")
    long = {"max_tokens": 160, "ignore_eos": True}
    uncut = chat(door.url, messages, capture, **long)
    assert uncut.status_code == 200, uncut.text
    (uncut_row,) = staging.rows([uncut.json()["ng_commit_coords"]["staging_key"]])
    holder = httpx.Client(base_url=door.url, timeout=120)
    held_by = pid_of(holder)
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(holder.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY, **long,
                                      "ng_capture": capture})))
    cutter = httpx.Client(base_url=door.url, timeout=60)
    while pid_of(cutter) == held_by:  # the cut reaches the process that does not hold the call
        cutter.close()
        cutter = httpx.Client(base_url=door.url, timeout=60)
    thread.start()
    acks, attempt = [], 0
    while thread.is_alive():  # a cut every 50 ms while the call decodes: chunk after chunk
        attempt += 1
        receipt = cut(cutter, inventory(f"ckpt-{attempt}", [("resume", "call-0")])).json()
        (acked,) = receipt["prefixes"]
        if acked["disposition"] == "durable_prefix":
            acks.append(acked)
        time.sleep(0.05)
    thread.join(timeout=120)
    holder.close()
    cutter.close()
    assert len(acks) >= 2, f"{len(acks)} cuts reached the call while it decoded"
    ack = acks[-1]
    assert len(ack["staging_keys"]) == len({tuple(a["staging_keys"]) for a in acks})
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert 0 < ack["prefix_token_count"] < long["max_tokens"]
    (cut_row,) = staging.rows(["resume/call-0"])
    assert cut_row == uncut_row  # decoding went on unchanged past the cut
    continuation = {name: ack[name] for name in ("staging_keys", "prefix_token_count",
                                                 "prefix_digest", "effective_output_limit")}
    resumed = chat(door.url, messages, {**capture, "generation_cut": {
        **continuation, "source_capture_key": "resume", "source_model_call_id": "call-0"}},
        **long)
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
