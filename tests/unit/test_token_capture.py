"""NeMo-Gym's worker-owned token capture (core/capture_*.py, core/token_capture.py): the
admission's rules, a turn's delta, the digests against values computed here by hand from
Gym's byte layout (and Gym's own conformance vector), the commit coordinates, and the
service that stages a turn before its answer."""

from __future__ import annotations

import hashlib
import struct

import pytest

from rollout_fleet.adapters.transfer_queue import InMemoryStaging
from rollout_fleet.core.capture_admission import CaptureAdmission, CaptureRefused, staging_key
from rollout_fleet.core.capture_digest import (
    EMPTY_EXTRAS_DIGEST, chain_hash, extras_digest, row_digest, tokens_hash,
)
from rollout_fleet.core.capture_records import (
    CommitCoords, StagedRowMissing, StagingChainBroken, build_row, turn_delta,
)
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.token_capture import (
    CallAlreadyCompleted, TokenCapture, WeightVersionSource, answer_with_coords,
)

H = "ab" * 32  # a parent chain hash


def q(value: int) -> bytes:
    return struct.pack(">Q", value)


def sha(*parts: bytes) -> str:
    return hashlib.sha256(b"".join(parts)).hexdigest()


def root(**changes):
    return {"rollout_id": "r1", "model_call_id": "c0", "mode": "text", **changes}


def child(**changes):
    return {"rollout_id": "r1", "model_call_id": "c1", "mode": "token_in", "parent_call_id": "c0",
            "prev_len": 2, "required_prefix_token_ids": [1, 2], "parent_chain_hash": H,
            **changes}


# ---- the admission -------------------------------------------------------------------------

def test_an_admission_reads_as_gym_writes_it():
    wire = {"schema_version": 2, "rollout_id": "r1", "model_call_id": "c1",
            "parent_call_id": "c0", "prev_len": 2, "mode": "token_in",
            "required_prefix_token_ids": [1, 2], "staging_chain": [],
            "parent_chain_hash": H, "generation_cut": None}
    admission = CaptureAdmission.from_wire(wire)
    assert admission.to_wire() == wire and list(admission.to_wire()) == list(wire)
    assert admission.staging_key == "r1/c1" == staging_key("r1", "c1")
    by_chain = CaptureAdmission.from_wire(child(required_prefix_token_ids=[],
                                                staging_chain=["r1/c0"]))
    assert by_chain.staging_chain == ("r1/c0",) and by_chain.required_prefix_token_ids == ()
    assert CaptureAdmission.from_wire(root()).to_wire()["parent_call_id"] is None


@pytest.mark.parametrize("wire, field", [
    ("not an object", "ng_capture"),
    (root(surprise=1), "ng_capture.surprise"),
    ({"model_call_id": "c0", "mode": "text"}, "ng_capture.rollout_id"),
    (root(rollout_id=""), "ng_capture.rollout_id"),
    (root(model_call_id=7), "ng_capture.model_call_id"),
    (root(mode="tokens"), "ng_capture.mode"),
    (root(schema_version=3), "ng_capture.schema_version"),
    (root(generation_cut={"staging_keys": ["x"]}), "ng_capture.generation_cut"),
    (child(prev_len=True), "ng_capture.prev_len"),
    (child(prev_len=-1), "ng_capture.prev_len"),
    (child(required_prefix_token_ids="12"), "ng_capture.required_prefix_token_ids"),
    (child(required_prefix_token_ids=[1, -2]), "ng_capture.required_prefix_token_ids"),
    (child(required_prefix_token_ids=[1, True]), "ng_capture.required_prefix_token_ids"),
    (child(staging_chain=[""]), "ng_capture.staging_chain"),
    (child(staging_chain="r1/c0"), "ng_capture.staging_chain"),
    (child(parent_chain_hash=H.upper()), "ng_capture.parent_chain_hash"),
    (child(parent_call_id=None), "ng_capture.parent_call_id"),
    (child(prev_len=0, required_prefix_token_ids=[]), "ng_capture.prev_len"),
    (child(parent_chain_hash=None), "ng_capture.parent_chain_hash"),
    (child(required_prefix_token_ids=[1]), "ng_capture.required_prefix_token_ids"),
    (root(parent_call_id="c9"), "ng_capture.parent_call_id"),
    (root(prev_len=2), "ng_capture.prev_len"),
    (root(staging_chain=["r1/c0"]), "ng_capture.staging_chain"),
    (root(required_prefix_token_ids=[1]), "ng_capture.required_prefix_token_ids"),
    (root(parent_chain_hash=H), "ng_capture.parent_chain_hash"),
])
def test_each_broken_rule_is_refused_by_its_field(wire, field):
    with pytest.raises(CaptureRefused) as refused:
        CaptureAdmission.from_wire(wire)
    assert refused.value.field == field
    assert isinstance(refused.value, InvalidValue) and field in str(refused.value)


def test_the_prefix_is_resolved_as_gym_resolves_it():
    text = CaptureAdmission.from_wire(root())
    assert text.resolve_prefix(None) == () == text.resolve_prefix([])
    with pytest.raises(CaptureRefused, match="text root"):
        text.resolve_prefix([1])
    inline = CaptureAdmission.from_wire(child())
    assert inline.resolve_prefix(None) == (1, 2) == inline.resolve_prefix([1, 2])
    with pytest.raises(CaptureRefused, match="differ"):
        inline.resolve_prefix([1, 3])
    chained = CaptureAdmission.from_wire(child(required_prefix_token_ids=[],
                                               staging_chain=["r1/c0"]))
    assert chained.resolve_prefix([4, 5]) == (4, 5)
    with pytest.raises(CaptureRefused, match="read back"):
        chained.resolve_prefix(None)
    with pytest.raises(CaptureRefused, match="prev_len=2") as short:
        chained.resolve_prefix([4], field="ng_capture.staging_chain")
    assert short.value.field == "ng_capture.staging_chain"


# ---- the delta and the digests -------------------------------------------------------------

def test_a_turns_delta_is_the_new_prompt_then_the_generation():
    delta = turn_delta([1, 2, 3, 4], [5, 6], [-0.5, -0.25], prev_len=2)
    assert delta.token_ids == (3, 4, 5, 6)
    assert delta.token_mask == (0.0, 0.0, 1.0, 1.0)
    assert delta.logprobs == (0.0, 0.0, -0.5, -0.25)
    held = turn_delta([1], [2], [-0.1], 0).logprobs  # as float32, as the staged column holds it
    assert held == (0.0, struct.unpack(">f", struct.pack(">f", -0.1))[0]) != (0.0, -0.1)
    for args in (([1], [2], [-0.1, -0.2], 0), ([1], [], [], 1), ([1], [2], [-0.1], 2),
                 ([1], [2], [float("nan")], 0), ([1], [2], [1e39], 0), ([1], [2], [10**400], 0)):
        with pytest.raises(InvalidValue):
            turn_delta(*args)


def test_the_token_and_chain_hashes_follow_gyms_layout():
    assert tokens_hash([]) == sha(b"nemo-gym-staging-prefix-v2", q(0))
    assert tokens_hash([1, 2**40]) == sha(b"nemo-gym-staging-prefix-v2", q(2), q(1), q(2**40))
    assert chain_hash(None, [5]) == sha(b"nemo-gym-staging-chain-v1", b"\x00", q(1), q(5))
    assert chain_hash(H, [5, 6]) == sha(b"nemo-gym-staging-chain-v1", b"\x01",
                                        bytes.fromhex(H), q(2), q(5), q(6))
    assert EMPTY_EXTRAS_DIGEST == extras_digest(None) == sha(b"nemo-gym-staging-extras-v1",
                                                             b"\x01N")
    assert extras_digest({"b": True, "a": [1, "x"]}) == sha(
        b"nemo-gym-staging-extras-v1", b"\x01D", q(2), q(1), b"a", b"L", q(2),
        b"I" + struct.pack(">q", 1), b"S", q(1), b"x", q(1), b"b", b"B\x01")
    for bad in ([-1], [2**64]):
        with pytest.raises(InvalidValue):
            tokens_hash(bad)
    with pytest.raises(InvalidValue):
        extras_digest({"t": (1, 2)})


def test_gyms_conformance_vector():
    # NeMo-Gym's staging/conformance/golden_vectors.json. Its row is of a later schema (3),
    # whose layout differs from schema 2 in its first byte only.
    extras = {"routed_experts": [[[1, 2]], [[3, 4]]]}
    golden_extras = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
    assert extras_digest(extras) == golden_extras
    digest = row_digest(
        rollout_id="rollout-1", model_call_id="call-1", parent_call_id="parent-1",
        mode="token_in", lengths=(3, 2, 5), weight_version=7, token_ids_delta=[10, 11],
        token_mask_delta=[0.0, 1.0], generation_logprobs_delta=[0.0, -0.25],
        extras_digest=golden_extras, chain_hash="1" * 64, cumulative_hash="2" * 64,
        schema_version=3)
    assert digest == "cdd62002cf93637646f8501ae816eada76e315885219455f53a09dd5a86580f2"


def _by_hand_root_digest(logprob_bits: bytes, weight_version: int) -> str:
    text = lambda s: q(len(s)) + s.encode()  # noqa: E731
    chain = chain_hash(None, [7, 8, 9])
    cumulative = tokens_hash([7, 8, 9])
    payload = (bytes([2, 2, 1]) + text("r1") + text("c0") + b"\x00" + text("text")
               + q(0) + q(3) + q(3) + q(weight_version)
               + q(32) + q(3) + q(7) + q(8) + q(9)
               + q(20) + q(3) + struct.pack(">fff", 0.0, 0.0, 1.0)
               + q(20) + q(3) + struct.pack(">ff", 0.0, 0.0) + logprob_bits
               + bytes.fromhex(EMPTY_EXTRAS_DIGEST) + b"\x01" + bytes.fromhex(chain)
               + b"\x01" + bytes.fromhex(cumulative))
    return sha(b"nemo-gym-staging-call-v2", payload)


def test_a_rows_digest_is_gyms_v2_digest():
    admission = CaptureAdmission.from_wire(root())
    row = build_row(admission, (), 4, [7, 8], [9], [-0.1])
    assert row.digest == _by_hand_root_digest(struct.pack(">f", -0.1), 4)
    assert row.chain_hash == chain_hash(None, [7, 8, 9])
    assert row.cumulative_hash == tokens_hash([7, 8, 9])
    assert (row.delta_len, row.cum_len, row.staging_key) == (3, 3, "r1/c0")
    row.verify()
    negative_zero = build_row(admission, (), 4, [7, 8], [9], [-0.0])
    assert negative_zero.digest == _by_hand_root_digest(b"\x80\x00\x00\x00", 4) != \
        build_row(admission, (), 4, [7, 8], [9], [0.0]).digest


def test_a_continuation_hashes_the_whole_sequence_and_chains_from_its_parent():
    first = build_row(CaptureAdmission.from_wire(root()), (), 0, [1], [2], [-1.0])
    admission = CaptureAdmission.from_wire(child(parent_chain_hash=first.chain_hash))
    row = build_row(admission, (1, 2), 1, [1, 2, 3], [4, 5], [-0.5, -1.5])
    assert row.token_ids_delta == (3, 4, 5) and row.cum_len == 5
    assert row.cumulative_hash == tokens_hash([1, 2, 3, 4, 5])
    assert row.chain_hash == chain_hash(first.chain_hash, [3, 4, 5])
    with pytest.raises(CaptureRefused, match="admitted prefix"):
        build_row(admission, (1, 2), 1, [1, 9, 3], [4], [-0.5])


# ---- the commit coordinates ----------------------------------------------------------------

def test_staged_and_failed_coordinates_are_gyms_schema_2():
    row = build_row(CaptureAdmission.from_wire(root()), (), 3, [7, 8], [9], [-0.1])
    wire = CommitCoords.staged(row).to_wire()
    assert list(wire) == ["schema_version", "digest_version", "extras_digest_version",
                          "rollout_id", "model_call_id", "parent_call_id", "prev_len",
                          "delta_len", "cum_len", "weight_version", "disposition", "digest",
                          "extras_digest", "staging_key", "chain_hash", "cumulative_hash"]
    assert wire == {"schema_version": 2, "digest_version": 2, "extras_digest_version": 1,
                    "rollout_id": "r1", "model_call_id": "c0", "parent_call_id": None,
                    "prev_len": 0, "delta_len": 3, "cum_len": 3, "weight_version": 3,
                    "disposition": "staged", "digest": row.digest,
                    "extras_digest": EMPTY_EXTRAS_DIGEST, "staging_key": "r1/c0",
                    "chain_hash": row.chain_hash, "cumulative_hash": row.cumulative_hash}
    assert CommitCoords.from_wire(wire) == CommitCoords.staged(row)
    failed = CommitCoords.capture_failed(CaptureAdmission.from_wire(child()), 5, "why")
    assert failed.to_wire() == {**{name: None for name in ("digest", "extras_digest",
                                                           "staging_key", "chain_hash",
                                                           "cumulative_hash")},
                                "schema_version": 2, "digest_version": 2,
                                "extras_digest_version": 1, "rollout_id": "r1",
                                "model_call_id": "c1", "parent_call_id": "c0", "prev_len": 2,
                                "delta_len": 0, "cum_len": 2, "weight_version": 5,
                                "disposition": "capture_failed"}
    assert failed.failure == "why" and "why" not in str(failed.to_wire())
    for broken in ({**wire, "digest": None}, {**wire, "delta_len": 0, "cum_len": 0},
                   {**wire, "cum_len": 4}, {**wire, "extra": 1},
                   {**failed.to_wire(), "digest": row.digest}, {**wire, "prev_len": 1}):
        with pytest.raises(InvalidValue):
            CommitCoords.from_wire(broken)


# ---- the service ---------------------------------------------------------------------------

class RefusingStaging(InMemoryStaging):
    def stage(self, row):
        raise OSError("disk full")


def test_a_trajectory_is_staged_turn_by_turn_and_continued_from_its_chain():
    staging, versions = InMemoryStaging(), WeightVersionSource()
    capture = TokenCapture(staging, versions)
    call = capture.admit(root())
    first = capture.complete(call, [7, 8], [9, 10], [-0.5, -0.25])
    assert first.disposition == "staged" and staging.keys() == ["r1/c0"]
    versions.set(4)
    second = capture.admit(child(prev_len=4, required_prefix_token_ids=[],
                                 staging_chain=[first.staging_key],
                                 parent_chain_hash=first.chain_hash))
    assert second.prefix == (7, 8, 9, 10) and second.weight_version == 4
    versions.set(5)  # a refit lands while the turn generates: it keeps its admitted version
    coords = capture.complete(second, [7, 8, 9, 10, 11], [12], [-2.0])
    assert (coords.parent_call_id, coords.prev_len, coords.delta_len, coords.cum_len,
            coords.weight_version) == ("c0", 4, 2, 6, 4)
    rows = staging.rows(["r1/c0", "r1/c1"])
    assert [row.weight_version for row in rows] == [0, 4]
    assert staging.prefix(["r1/c0", "r1/c1"], parent_chain_hash=coords.chain_hash) == \
        [7, 8, 9, 10, 11, 12]
    with pytest.raises(CallAlreadyCompleted):
        capture.complete(second, [7, 8, 9, 10, 11], [12], [-2.0])


def test_a_turn_that_cannot_be_staged_answers_capture_failed():
    staging = InMemoryStaging()
    capture = TokenCapture(staging, WeightVersionSource(2))
    off_prefix = capture.complete(capture.admit(child()), [1, 3, 4], [5], [-1.0])
    not_finite = capture.complete(capture.admit(root()), [1], [2], [float("-inf")])
    refused = TokenCapture(RefusingStaging(), WeightVersionSource(2))
    unstored = refused.complete(refused.admit(root()), [1], [2], [-1.0])
    for coords, why in ((off_prefix, "admitted prefix"), (not_finite, "finite"),
                        (unstored, "OSError: disk full")):
        assert coords.disposition == "capture_failed" and why in coords.failure
        assert (coords.delta_len, coords.cum_len, coords.digest, coords.weight_version) == (
            0, coords.prev_len, None, 2)
    assert staging.keys() == []
    call = capture.admit(root(model_call_id="c5"))
    assert capture.fail(call, "engine died").failure == "engine died"
    with pytest.raises(CallAlreadyCompleted):
        capture.complete(call, [1], [2], [-1.0])


def test_admission_refuses_streams_and_chains_staging_cannot_give():
    staging = InMemoryStaging()
    capture = TokenCapture(staging, WeightVersionSource())
    with pytest.raises(CaptureRefused) as streamed:
        capture.admit(root(), stream=True)
    assert streamed.value.field == "stream"
    chained = child(required_prefix_token_ids=[], staging_chain=["r1/c0"])
    with pytest.raises(StagedRowMissing) as missing:
        capture.admit(chained)
    assert missing.value.field == "staging_chain[0]"
    first = capture.complete(capture.admit(root()), [1], [2], [-1.0])
    with pytest.raises(StagingChainBroken, match="parent_chain_hash"):
        capture.admit(chained)  # the chain ends at first.chain_hash, not H
    with pytest.raises(CaptureRefused) as long_chain:
        capture.admit({**chained, "prev_len": 3, "parent_chain_hash": first.chain_hash})
    assert long_chain.value.field == "ng_capture.staging_chain"
    assert capture.admit(chained, [1, 2]).prefix == (1, 2)  # a prefix the door read itself
    for bad in (-1, True, 1.0):
        with pytest.raises(InvalidValue):
            WeightVersionSource().set(bad)


def test_the_answer_carries_coordinates_and_no_tokens():
    row = build_row(CaptureAdmission.from_wire(root()), (), 0, [1], [2], [-1.0])
    coords = CommitCoords.staged(row)
    answer = {"id": "c0", "prompt_token_ids": [1], "prompt_logprobs": None, "choices": [
        {"index": 0, "finish_reason": "stop", "token_ids": [2],
         "logprobs": {"content": [{"token": "token_id:2", "logprob": -1.0}]},
         "message": {"role": "assistant", "content": "hi", "prompt_token_ids": [1],
                     "generation_token_ids": [2], "generation_log_probs": [-1.0],
                     "routed_experts": None}}], "usage": {"completion_tokens": 1}}
    sent = answer_with_coords(answer, coords)
    assert sent == {"id": "c0", "usage": {"completion_tokens": 1},
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "hi"}}],
                    "ng_commit_coords": coords.to_wire()}
    assert answer["choices"][0]["message"]["generation_token_ids"] == [2]  # left as it was
