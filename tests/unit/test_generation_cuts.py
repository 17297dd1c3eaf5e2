"""The pure parts of the door's token capture beyond a turn: NeMo-Gym's generation-cut wire
(an inventory read as Gym writes it, a receipt as Gym validates it, a continuation), a call cut
twice while it decodes and restored from its chunks (the restored row is the uncut row; a
tampered continuation is refused by field), and the on-policy sampling guard."""

from __future__ import annotations

import hashlib
import json

import attrs
import pytest

from rollout_fleet.adapters.transfer_queue import InMemoryStaging
from rollout_fleet.core.capture_admission import CaptureAdmission, CaptureRefused
from rollout_fleet.core.capture_records import build_row
from rollout_fleet.core.cut_prefix import (
    CutProgress, chunk_row, prefix_digest, restored_prefix,
)
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.generation_cut import (
    CutContinuation, CutInventory, DurablePrefix, PrefixAck, receipt, split_continuation,
)
from rollout_fleet.core.sampling_guard import OffPolicySampling, SamplingProfiles


def gym_inventory(checkpoint: str, calls: list[tuple[str, int, str]]) -> dict:
    """An inventory as Gym's ``GenerationCutInventory.build`` writes it."""
    prefixes = sorted(({"ticket_id": f"t-{call}", "rollout_id": rollout, "attempt": attempt,
                        "model_call_id": call, "admitted_at": 2.25}
                       for rollout, attempt, call in calls), key=lambda p: p["ticket_id"])
    payload = {"checkpoint_id": checkpoint, "server_name": "policy", "active_prefixes": prefixes}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"))
                            .encode()).hexdigest()
    return {**payload, "inventory_digest": digest}


def test_an_inventory_is_echoed_and_every_call_acknowledged_once():
    wire = gym_inventory("ckpt-1", [("r1", 0, "c1"), ("r2", 2, "c2")])
    inventory = CutInventory.from_wire(wire)
    assert inventory.to_wire() == wire
    assert [p.capture_key for p in inventory.active_prefixes] == ["r1", "r2-a2"]
    durable = PrefixAck(inventory.active_prefixes[0], DurablePrefix(
        "active/ckpt-1/0", ("k1", "k2"), 7, "a" * 64, 32)).to_wire()
    answer = receipt(inventory, {"t-c1": durable})
    assert answer["inventory"] == wire and answer["inventory_digest"] == wire["inventory_digest"]
    first, second = answer["prefixes"]
    assert (first["disposition"], first["cut_kind"], first["staging_keys"],
            first["prefix_token_count"]) == ("durable_prefix", "active_prefix", ["k1", "k2"], 7)
    assert (second["disposition"], second["staging_keys"], second["prefix_digest"]) == (
        "durable_failure", [], None)
    assert {k: second[k] for k in ("ticket_id", "rollout_id", "attempt", "model_call_id",
                                   "admitted_at")} == wire["active_prefixes"][1]


@pytest.mark.parametrize("change, field", [
    ({"extra": 1}, "extra"),
    ({"inventory_digest": "ABC"}, "inventory_digest"),
    ({"active_prefixes": [{"ticket_id": "t", "rollout_id": "a/b", "attempt": 0,
                           "model_call_id": "c", "admitted_at": 1.0}]},
     "active_prefixes[0].rollout_id"),
    ({"active_prefixes": [{"ticket_id": "t", "rollout_id": "a", "attempt": True,
                           "model_call_id": "c", "admitted_at": 1.0}]},
     "active_prefixes[0].attempt"),
])
def test_an_inventory_out_of_gyms_schema_is_refused_by_field(change, field):
    with pytest.raises(InvalidValue) as refused:
        CutInventory.from_wire({**gym_inventory("c", [("r", 0, "x")]), **change})
    assert refused.value.field == field


PROMPT, PREFIX = [5, 6, 7, 8], [5, 6]
ADMISSION = CaptureAdmission("roll", "call-1", "token_in", parent_call_id="call-0", prev_len=2,
                             required_prefix_token_ids=(5, 6), parent_chain_hash="c" * 64)
GENERATED = [40 + i for i in range(9)]
LOGPROBS = [-0.1 * (i + 1) for i in range(9)]


def cut_twice(staging):
    """A live call cut after 3 generated tokens and after 7 (decoding going on while each
    chunk is staged); the second cut's keys and prefix digest."""
    progress = CutProgress()
    progress.observe(GENERATED[:3], LOGPROBS[:3])
    digest = ""
    for checkpoint, more in (("ck-a", slice(3, 5)), ("ck-b", slice(7, 8))):
        frozen = progress.freeze()
        progress.observe(GENERATED[more], LOGPROBS[more])  # decoding goes on
        row = chunk_row(ADMISSION, checkpoint, frozen.sequence, frozen.token_ids,
                        frozen.logprobs, 4)
        staging.stage(row)
        progress.seal(frozen, row.staging_key)
        digest = prefix_digest(ADMISSION, PREFIX, 4, PROMPT, *progress.generated(frozen.upto))
        if checkpoint == "ck-a":
            progress.observe(GENERATED[5:7], LOGPROBS[5:7])
    return list(progress.staging_keys), digest


def test_a_call_cut_twice_and_restored_stages_the_row_of_the_call_never_cut():
    staging = InMemoryStaging()
    keys, digest = cut_twice(staging)
    assert keys == ["generation-cut/ck-a/roll/call-1/chunk-0",
                    "generation-cut/ck-b/roll/call-1/chunk-1"]
    wire = {"source_capture_key": "roll", "source_model_call_id": "call-1",
            "staging_keys": keys, "prefix_token_count": 7, "prefix_digest": digest,
            "effective_output_limit": 9, "schema_version": 2}
    ng_capture = {**ADMISSION.to_wire(), "rollout_id": "roll-a1", "generation_cut": wire}
    admission_wire, continuation = split_continuation(ng_capture)
    restored_admission = CaptureAdmission.from_wire(admission_wire)
    rows = staging.rows(continuation.staging_keys)
    restored = restored_prefix(continuation, restored_admission, PREFIX, PROMPT, rows, 5)
    assert list(restored.token_ids) == GENERATED[:7] and restored.weight_version == 4
    whole = build_row(ADMISSION, PREFIX, 4, PROMPT, [*restored.token_ids, *GENERATED[7:]],
                      [*restored.logprobs, *LOGPROBS[7:]])
    assert whole == build_row(ADMISSION, PREFIX, 4, PROMPT, GENERATED, LOGPROBS)
    for change, field, version in (({"prefix_token_count": 6}, "prefix_token_count", 5),
                                   ({"prefix_digest": "0" * 64}, "prefix_digest", 5),
                                   ({"effective_output_limit": 7}, "effective_output_limit", 5),
                                   ({}, "staging_keys", 3)):
        tampered = attrs.evolve(continuation, **change)
        with pytest.raises(CaptureRefused) as refused:
            restored_prefix(tampered, restored_admission, PREFIX, PROMPT, rows, version)
        assert refused.value.field == f"ng_capture.generation_cut.{field}"
    with pytest.raises(CaptureRefused, match="not the call that was cut"):
        restored_prefix(continuation, restored_admission, PREFIX, [*PROMPT, 9], rows, 5)
    with pytest.raises(InvalidValue) as unknown:
        CutContinuation.from_wire({**wire, "digest": "a" * 64})
    assert unknown.value.field == "ng_capture.generation_cut.digest"


def test_a_call_ended_or_not_yet_generating_is_not_cut():
    progress = CutProgress()
    assert progress.freeze() is None
    progress.observe([1], [-0.5])
    assert progress.freeze() is not None
    progress.observe([2], [])
    assert progress.broken and progress.freeze() is None


PROFILES = SamplingProfiles.from_wire({"temperature": 1.0, "top_p": 1.0,
                                       "val_temperature": 0.0, "val_top_p": 0.95})


@pytest.mark.parametrize("body, field", [
    ({"temperature": 1.0, "top_p": 1.0, "top_k": 20}, "top_k"),
    ({"temperature": 1.0}, "top_p"),
    ({"temperature": 0.7, "top_p": 1.0}, "temperature"),
    ({"temperature": 0.0, "top_p": 1.0}, "top_p"),
    ({"top_p": 1.0}, "temperature"),
])
def test_the_sampling_guard_names_the_field_the_value_and_both_profiles(body, field):
    with pytest.raises(OffPolicySampling) as refused:
        PROFILES.check(body)
    assert refused.value.field == field
    if field != "top_k":
        assert "train (temperature=1, top_p=1), validation (temperature=0, top_p=0.95)" in \
            str(refused.value)


def test_the_sampling_guard_passes_either_profile():
    PROFILES.check({"temperature": 1, "top_p": 1.0, "top_k": -1})
    PROFILES.check({"temperature": 0.0, "top_p": 0.95})
    assert SamplingProfiles.from_wire({"temperature": 0.6, "top_p": 0.9}).validation == \
        SamplingProfiles.from_wire({"temperature": 0.6, "top_p": 0.9}).train
    with pytest.raises(InvalidValue) as refused:
        SamplingProfiles.from_wire({"temperature": 1.0, "top_p": 1.0, "top_k": 5})
    assert refused.value.field == "sampling.top_k"
