"""Hostile input for refit specs, and the packing plan's invariants.

Any input to TensorMeta / RefitInfo / CollectiveSenderSpec builds a valid value or raises
InvalidValue; valid values survive the wire; plan_buckets keeps order, aligns and never overlaps.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import (
    BUFFER_ALIGN,
    DTYPE_BYTES,
    CollectiveSenderSpec,
    RankLayout,
    RefitInfo,
    RefitProtocol,
    TensorMeta,
    dtype_name,
    max_bucket_bytes,
    plan_buckets,
)
from tests.unit.hostile import json_values, mutated, python_values

dtypes = st.sampled_from(sorted(DTYPE_BYTES))
shapes = st.lists(st.integers(0, 64), max_size=4).map(tuple)
metas = st.builds(TensorMeta, name=st.text(min_size=1, max_size=12), shape=shapes, dtype=dtypes)
infos = st.builds(
    RefitInfo,
    tensors=st.lists(metas, max_size=8, unique_by=lambda m: m.name).map(tuple),
    packed=st.booleans(),
)
VALID_SENDER = CollectiveSenderSpec(buffer_bytes=4096, num_buffers=2).to_wire()
VALID_ENTRY = ["w", [2, 3], "float32"]


def _build_or_invalid(build, *args):
    try:
        return build(*args)
    except InvalidValue:
        return None


# ---------------------------------------------------------------- values from the wire

@settings(max_examples=120)
@given(python_values, python_values, python_values)
def test_any_tensor_meta_builds_or_raises_invalid_value(name, shape, dtype):
    meta = _build_or_invalid(TensorMeta, name, shape, dtype)
    if meta is not None:
        assert isinstance(meta.name, str) and meta.name
        assert all(type(d) is int and d >= 0 for d in meta.shape)
        assert meta.nbytes == meta.numel * DTYPE_BYTES[meta.dtype]


@given(python_values | dtypes.map("torch.{}".format))
def test_any_dtype_name_is_known_or_invalid(dtype):
    name = _build_or_invalid(dtype_name, dtype)
    assert name is None or name in DTYPE_BYTES


def test_a_huge_int_dtype_is_invalid_not_unprintable():
    # Found by the property above: str(10**5000) raised ValueError.
    with pytest.raises(InvalidValue, match="dtype=<unprintable int>"):
        dtype_name(10**5000)


@pytest.mark.parametrize("shape", ["", "12", b"\x01", {"a": 1}])
def test_a_string_or_mapping_is_not_a_shape(shape):
    # Found by the property above: TensorMeta("w", "", "float32") built a scalar.
    with pytest.raises(InvalidValue, match="shape of 'w'"):
        TensorMeta("w", shape, "float32")


@settings(max_examples=120)
@given(python_values
       | st.builds(lambda entries, packed: {"tensors": entries, "packed": packed},
                   st.lists(mutated({"name": "w", "shape": [2, 3], "dtype": "float32"}).map(
                       lambda d: list(d.values())) | st.lists(json_values, max_size=4), max_size=4),
                   json_values)
       | mutated({"tensors": [VALID_ENTRY], "packed": True}))
def test_any_refit_info_wire_reads_or_raises_invalid_value(data):
    info = _build_or_invalid(RefitInfo.from_wire, data)
    if info is not None:
        assert isinstance(info.packed, bool)
        assert len({t.name for t in info.tensors}) == len(info.tensors)


@pytest.mark.parametrize("packed", ["false", 0, 1, None, []])
def test_refit_info_packed_is_a_bool(packed):
    # Found by the property above: bool("false") read as packed=True.
    with pytest.raises(InvalidValue, match="refit_info.packed"):
        RefitInfo.from_wire({"tensors": [VALID_ENTRY], "packed": packed})


@settings(max_examples=120)
@given(python_values | st.dictionaries(st.text(max_size=6) | python_values.filter(_hashable := (
    lambda v: isinstance(v, (int, str, float, bytes, type(None), frozenset)))),
    st.tuples(python_values, python_values) | python_values, max_size=4))
def test_any_state_dict_info_reads_or_raises_invalid_value(info):
    refit = _build_or_invalid(RefitInfo.from_state_dict_info, info)
    if refit is not None:
        assert [t.name for t in refit.tensors] == list(info)


@settings(max_examples=100)
@given(infos)
def test_refit_info_round_trips_through_json_and_state_dict_info(info):
    assert RefitInfo.from_wire(json.loads(json.dumps(info.to_wire()))) == info
    state_dict_info = {t.name: (t.shape, f"torch.{t.dtype}") for t in info.tensors}
    assert RefitInfo.from_state_dict_info(state_dict_info, info.packed) == info


@settings(max_examples=120)
@given(python_values | mutated(VALID_SENDER, python_values))
def test_any_sender_spec_reads_or_raises_invalid_value(data):
    spec = _build_or_invalid(CollectiveSenderSpec.from_wire, data)
    if spec is not None:
        assert isinstance(spec.protocol, str) and spec.buffer_bytes >= 1 and spec.num_buffers >= 1
        assert CollectiveSenderSpec.from_wire(json.loads(json.dumps(spec.to_wire()))) == spec


def test_sender_spec_with_keys_of_mixed_types_names_them():
    # Found by the property above: sorting int and str keys raised TypeError.
    with pytest.raises(InvalidValue, match="unknown keys"):
        CollectiveSenderSpec.from_wire({1: 2, "x": 3, **VALID_SENDER})


@pytest.mark.parametrize("protocol", [5, "", None, ["rollout-fleet-packed-v1"], "no-such-protocol"])
def test_sender_spec_protocol_is_a_known_protocol(protocol):
    # Found by the property above: any value was taken as the protocol.
    with pytest.raises(InvalidValue, match="protocol=.*must be one of rollout-fleet-packed-v1, vllm"):
        CollectiveSenderSpec.from_wire({**VALID_SENDER, "protocol": protocol})


def test_a_sender_spec_reads_its_protocol_by_the_wire_spelling_and_writes_it_back():
    spec = CollectiveSenderSpec.from_wire({**VALID_SENDER, "protocol": "vllm"})
    assert spec.protocol is RefitProtocol.VLLM
    assert type(spec.to_wire()["protocol"]) is str and spec.to_wire()["protocol"] == "vllm"


# ---------------------------------------------------------------- packing plan

sized_metas = st.builds(
    TensorMeta, name=st.just("t"),
    shape=st.lists(st.integers(0, 300), max_size=2).map(tuple)
    | st.sampled_from([(0,), (10**6,), (2**40, 2**20)]),
    dtype=dtypes)
tensor_lists = st.lists(sized_metas, max_size=30).map(
    lambda ms: [TensorMeta(f"t{i}", m.shape, m.dtype) for i, m in enumerate(ms)])
limits = st.integers(1, 4 * BUFFER_ALIGN) | st.integers(1, 2**20) | st.sampled_from([1, 2**62, 10**400])


@settings(max_examples=300)
@given(tensor_lists, limits)
def test_plan_buckets_invariants(tensors, buffer_bytes):
    buckets = plan_buckets(tensors, buffer_bytes)
    # Order kept, every tensor exactly once.
    assert [e.meta for b in buckets for e in b.entries] == tensors
    for index, bucket in enumerate(buckets):
        assert bucket.entries, "no empty bucket"
        assert bucket.entries[0].offset == 0
        ends = []
        for entry in bucket.entries:
            assert entry.offset % BUFFER_ALIGN == 0
            assert not ends or entry.offset >= ends[-1], "tensors overlap"
            ends.append(entry.offset + entry.meta.nbytes)
        assert bucket.nbytes == ends[-1]
        # A bucket closes only when its last tensor reaches the limit (or the tensors run out),
        # and never before: every earlier tensor ended below the limit.
        assert all(end < buffer_bytes for end in ends[:-1])
        if index < len(buckets) - 1:
            assert bucket.nbytes >= buffer_bytes
    # Coverage: the payload of every tensor is inside some bucket.
    assert sum(e.meta.nbytes for b in buckets for e in b.entries) == sum(t.nbytes for t in tensors)
    assert max_bucket_bytes(buckets) == max((b.nbytes for b in buckets), default=0)


@given(tensor_lists, python_values | st.integers(max_value=0))
def test_plan_buckets_refuses_a_bad_limit(tensors, buffer_bytes):
    if type(buffer_bytes) is int and buffer_bytes >= 1:
        return
    with pytest.raises(InvalidValue, match="buffer_bytes"):
        plan_buckets(tensors, buffer_bytes)


# ---------------------------------------------------------------- rank layout

small = st.integers(1, 6)


@given(python_values | small, python_values | small, python_values | small)
def test_any_rank_layout_builds_or_raises_invalid_value(train, workers, per_worker):
    layout = _build_or_invalid(RankLayout, train, workers, per_worker)
    if layout is not None:
        assert layout.world_size == train + workers * per_worker


@given(small, small, small)
def test_worker_ranks_tile_the_world_after_the_trainer(train, workers, per_worker):
    layout = RankLayout(train, workers, per_worker)
    ranks = [layout.worker_rank(w, r) for w in range(workers) for r in range(per_worker)]
    assert ranks == list(range(train, layout.world_size))


@given(small, small, small, python_values | st.integers(-3, 9), python_values | st.integers(-3, 9))
def test_any_worker_rank_lookup_answers_or_raises_invalid_value(train, workers, per_worker, index, local):
    rank = _build_or_invalid(RankLayout(train, workers, per_worker).worker_rank, index, local)
    assert rank is None or (type(rank) is int and train <= rank < train + workers * per_worker)


@pytest.mark.parametrize("index", ["0", 1.5, None, True])
def test_worker_index_must_be_an_int(index):
    # Found by the property above: "0" raised TypeError, and 1.5 and True gave ranks.
    with pytest.raises(InvalidValue, match="worker_index"):
        RankLayout(1, 3).worker_rank(index)
