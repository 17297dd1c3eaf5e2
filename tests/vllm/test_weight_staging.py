"""The shared-memory staging file a CPU weight load goes through: reused, exact, removed."""

import os

import pytest
import torch

from rollout_fleet.adapters.vllm.engine import _SharedStaging, _staged_bytes


def _read_back(path, nbytes, entries):
    block = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    tensors = {}
    for name, dtype, shape, offset in entries:
        dtype = getattr(torch, dtype)
        size = torch.Size(shape).numel() * dtype.itemsize
        tensors[name] = block[offset:offset + size].view(dtype).reshape(shape).clone()
    return tensors


@pytest.fixture
def staging():
    staging = _SharedStaging()
    yield staging
    staging.close()  # also when a check failed: no file is left in /dev/shm


def test_loads_reuse_one_file_hold_the_exact_bytes_and_close_removes_it(staging):
    first = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
             ("c", torch.randn(4, dtype=torch.float64))]
    second = [("b", torch.arange(7, 14, dtype=torch.int64)), ("a", torch.randn(3, 5)),
              ("c", torch.randn(4, dtype=torch.float64))]  # same sizes, another order
    staging.reserve(_staged_bytes([t.numel() * t.element_size() for _, t in first]))
    paths = []
    for tensors in (first, second):
        with staging.holding(tensors) as (path, nbytes, entries):
            paths.append(path)
            assert path.startswith("/dev/shm/") and os.path.getsize(path) >= nbytes
            got = _read_back(path, nbytes, entries)
            assert all(torch.equal(got[name], tensor) for name, tensor in tensors)
            assert all(offset % 64 == 0 for *_, offset in entries)
    assert paths[0] == paths[1]  # reused, so its pages stay warm
    staging.close()
    assert not os.path.exists(paths[0])
    staging.close()  # twice is fine


def test_a_bigger_load_replaces_the_file_and_removes_the_old_one(staging):
    with staging.holding([("x", torch.zeros(8))]) as (small, *_):
        pass
    big = torch.randn(1 << 16)
    with staging.holding([("x", big)]) as (path, nbytes, entries):
        assert path != small and not os.path.exists(small)
        assert torch.equal(_read_back(path, nbytes, entries)["x"], big)
    staging.close()
    assert not os.path.exists(path)
