import pytest

from rollout_fleet.core.errors import InvalidValue, WorldSizeMismatch
from rollout_fleet.core.refit import (
    BUFFER_ALIGN, CollectiveSenderSpec, RankLayout, RefitInfo, TensorMeta, dtype_name, plan_buckets,
)


def metas(*sizes, dtype="uint8"):
    return [TensorMeta(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)]


def test_dtype_names_accept_torch_spellings():
    assert dtype_name("torch.bfloat16") == "bfloat16" and dtype_name("float32") == "float32"
    with pytest.raises(InvalidValue):
        dtype_name("complex32")


def test_tensor_meta_sizes():
    t = TensorMeta("w", (3, 4), "bfloat16")
    assert t.numel == 12 and t.nbytes == 24
    with pytest.raises(InvalidValue):
        TensorMeta("w", (3, -1), "float32")


def test_refit_info_from_state_dict_info_and_wire_round_trip():
    info = RefitInfo.from_state_dict_info({"a": ((2, 3), "torch.float32"), "b": ([4], "int64")})
    assert [t.name for t in info.tensors] == ["a", "b"] and info.total_bytes == 24 + 32
    assert RefitInfo.from_wire(info.to_wire()) == info


@pytest.mark.parametrize("bad", [{"a": (2, 3)}, {"a": "x"}, [("a", 1)]])
def test_refit_info_refuses_malformed_input(bad):
    with pytest.raises(InvalidValue):
        RefitInfo.from_state_dict_info(bad)


def test_refit_info_checks_names_shapes_dtypes_against_the_engine():
    engine = {"a": TensorMeta("a", (2, 3), "float32")}
    RefitInfo((TensorMeta("a", (2, 3), "float32"),)).check_against(engine)
    for wrong, field in [(TensorMeta("z", (2, 3), "float32"), "tensor name"),
                         (TensorMeta("a", (3, 2), "float32"), "shape of 'a'"),
                         (TensorMeta("a", (2, 3), "bfloat16"), "dtype of 'a'")]:
        with pytest.raises(InvalidValue) as info:
            RefitInfo((wrong,)).check_against(engine)
        assert info.value.field == field


def test_buckets_close_on_the_tensor_that_crosses_the_limit():
    buckets = plan_buckets(metas(256, 256, 512, 100, 1000, 10), buffer_bytes=1000)
    names = [[e.meta.name for e in b.entries] for b in buckets]
    assert names == [["t0", "t1", "t2"], ["t3", "t4"], ["t5"]]
    assert [e.offset for e in buckets[0].entries] == [0, 256, 512]
    assert buckets[0].nbytes == 1024
    assert buckets[1].entries[1].offset == BUFFER_ALIGN  # 100 bytes rounded up
    assert buckets[2].nbytes == 10


def test_a_tensor_larger_than_the_buffer_travels_alone_and_order_is_kept():
    buckets = plan_buckets(metas(10, 5000, 10), buffer_bytes=1000)
    order = [e.meta.name for b in buckets for e in b.entries]
    assert order == ["t0", "t1", "t2"]
    assert [len(b.entries) for b in buckets] == [2, 1]


def test_offsets_are_aligned_and_do_not_overlap():
    buckets = plan_buckets(metas(3, 7, 1, 0, 900, dtype="float32"), buffer_bytes=4096)
    for bucket in buckets:
        end = 0
        for entry in bucket.entries:
            assert entry.offset % BUFFER_ALIGN == 0 and entry.offset >= end
            end = entry.offset + entry.meta.nbytes
        assert bucket.nbytes == end


def test_sender_spec_wire_and_validation():
    spec = CollectiveSenderSpec(buffer_bytes=1 << 20, num_buffers=3)
    assert CollectiveSenderSpec.from_wire(spec.to_wire()) == spec
    with pytest.raises(InvalidValue):
        CollectiveSenderSpec(buffer_bytes=0)
    with pytest.raises(InvalidValue):
        CollectiveSenderSpec.from_wire({"buffer_bytes": 1, "colour": "red"})


def test_rank_layout_puts_trainers_first():
    layout = RankLayout(train_world_size=4, num_workers=3, ranks_per_worker=2)
    assert layout.world_size == 10
    assert [layout.worker_rank(i) for i in range(3)] == [4, 6, 8]
    assert layout.worker_rank(2, 1) == 9
    layout.check_world_size(10)
    with pytest.raises(WorldSizeMismatch) as info:
        layout.check_world_size(9)
    assert "= 10" in str(info.value) and info.value.value == 9
    with pytest.raises(InvalidValue):
        layout.worker_rank(3)
