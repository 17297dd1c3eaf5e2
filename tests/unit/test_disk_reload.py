"""The refit from a checkpoint folder, without an engine: the core's checkpoint check on folders
as read (each defect refused naming its file or tensor), the reader of safetensors headers on
real files, the worker's controls and the driver's fan-out over in-memory workers (a folder one
worker refuses is loaded by none), and the refusal of an engine without the port."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from rollout_fleet.adapters.memory import LocalWorkerControl
from rollout_fleet.adapters.shared.checkpoint_files import read_checkpoint
from rollout_fleet.core.checkpoint_check import (
    CheckpointListing, SafetensorsFile, StoredTensor, check_checkpoint,
)
from rollout_fleet.core.disk_reload import DiskReload, WorkerDiskReload, refusing_disk_reload
from rollout_fleet.core.engine_ports import DiskReloadTarget
from rollout_fleet.core.errors import (
    IncompleteCheckpoint, InvalidValue, WeightMismatch, WorkerFailures,
)
from rollout_fleet.core.refit import RefitMode, TensorMeta, next_version
from rollout_fleet.core.refit_service import RefitCoordinator, worker_deadline_s

METAS = {"embed.weight": TensorMeta("embed.weight", (4, 2), "float32"),
         "norm.weight": TensorMeta("norm.weight", (2,), "float32")}
TIED = {"lm_head.weight": TensorMeta("lm_head.weight", (4, 2), "float32")}


def stored(name, shape, dtype="float32", begin=0):
    size = int(np.prod(shape)) * {"float32": 4, "bfloat16": 2, "int64": 8}[dtype]
    return StoredTensor(name, dtype, tuple(shape), begin, begin + size)


def one_file(*tensors, name="model.safetensors", header=64, size=None):
    data = sum(t.end - t.begin for t in tensors)
    return SafetensorsFile(name, 8 + header + data if size is None else size, header, tensors)


def listing(*files, folder="/ckpt/step-1", entries=None, index=None):
    names = tuple(f.name for f in files) + ("config.json",)
    return CheckpointListing(folder, names if entries is None else entries, files, index)


GOOD = listing(one_file(stored("embed.weight", (4, 2)), stored("norm.weight", (2,), begin=32)))


# -- the core's check -----------------------------------------------------------------------

def test_a_whole_folder_is_summarized():
    summary = check_checkpoint(GOOD, METAS)
    assert (summary.files, summary.tensors, summary.nbytes, summary.cast) == (
        ("model.safetensors",), 2, 40, ())
    assert summary.to_wire()["bytes"] == 40


def test_a_tied_name_may_come_or_not_and_a_float_dtype_is_cast():
    with_head = listing(one_file(stored("embed.weight", (4, 2)), stored("norm.weight", (2,), begin=32),
                                 stored("lm_head.weight", (4, 2), "bfloat16", begin=40)))
    summary = check_checkpoint(with_head, METAS, TIED)
    assert summary.tensors == 3 and summary.cast == ("lm_head.weight",)
    assert check_checkpoint(GOOD, METAS, TIED).tensors == 2


@pytest.mark.parametrize("checked, error, field, named", [
    (listing(*GOOD.files, folder="/ckpt/.version_00000002.tmp"), IncompleteCheckpoint,
     "checkpoint", ".tmp"),
    (listing(*GOOD.files, entries=("model.safetensors", "model.safetensors.tmp")),
     IncompleteCheckpoint, "checkpoint file", "model.safetensors.tmp"),
    (listing(entries=("config.json",)), IncompleteCheckpoint, "checkpoint", "no *.safetensors"),
    (listing(*GOOD.files, index={"embed.weight": "model-2.safetensors"}), IncompleteCheckpoint,
     "checkpoint file", "model-2.safetensors"),
    (listing(*GOOD.files, index={"embed.weight": "model.safetensors",
                                 "other.weight": "model.safetensors"}),
     IncompleteCheckpoint, "tensor", "other.weight"),
    (listing(one_file(*GOOD.files[0].tensors, size=8 + 64 + 36)), IncompleteCheckpoint,
     "checkpoint file", "'norm.weight' is cut"),
    (listing(one_file(*GOOD.files[0].tensors, size=30)), IncompleteCheckpoint,
     "checkpoint file", "shorter than its 64-byte header"),
    (listing(one_file(StoredTensor("embed.weight", "float32", (4, 2), 0, 16),
                      stored("norm.weight", (2,), begin=16))), IncompleteCheckpoint,
     "checkpoint file", "corrupt header"),
    (listing(one_file(*GOOD.files[0].tensors, size=8 + 64 + 44)), IncompleteCheckpoint,
     "checkpoint file", "corrupt file"),
    (listing(one_file(stored("embed.weight", (4, 2))),
             one_file(stored("embed.weight", (4, 2)), stored("norm.weight", (2,), begin=32),
                      name="model-2.safetensors")),
     IncompleteCheckpoint, "tensor", "stored twice"),
    (listing(one_file(*GOOD.files[0].tensors, stored("extra.weight", (2,), begin=40))),
     WeightMismatch, "tensor name", "extra.weight"),
    (listing(one_file(stored("embed.weight", (4, 3)), stored("norm.weight", (2,), begin=48))),
     WeightMismatch, "shape of 'embed.weight'", "in model.safetensors"),
    (listing(one_file(stored("embed.weight", (4, 2)), stored("norm.weight", (2,), "int64", 32))),
     WeightMismatch, "dtype of 'norm.weight'", "int64"),
    (listing(one_file(stored("embed.weight", (4, 2)))), WeightMismatch, "tensor names",
     "norm.weight"),
])
def test_each_defect_is_refused_naming_its_file_or_tensor(checked, error, field, named):
    with pytest.raises(error) as refused:
        check_checkpoint(checked, METAS, TIED)
    assert refused.value.field == field
    assert named in str(refused.value)


# -- the reader, on real files ---------------------------------------------------------------

def write_folder(folder, *, shards=1):
    folder.mkdir(parents=True)
    arrays = {"embed.weight": np.arange(8, dtype=np.float32).reshape(4, 2),
              "norm.weight": np.ones(2, dtype=np.float32)}
    if shards == 1:
        save_file(arrays, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for index, (name, array) in enumerate(arrays.items(), start=1):
            file = f"model-{index:05d}-of-00002.safetensors"
            save_file({name: array}, str(folder / file))
            weight_map[name] = file
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("shards", [1, 2])
def test_a_folder_as_written_reads_whole(tmp_path, shards):
    folder = write_folder(tmp_path / "step-1", shards=shards)
    summary = check_checkpoint(read_checkpoint(folder), METAS)
    assert summary.tensors == 2 and len(summary.files) == shards


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    path = write_folder(tmp_path / "step-1") / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(IncompleteCheckpoint, match="model.safetensors.*truncated"):
        check_checkpoint(read_checkpoint(path.parent), METAS)


@pytest.mark.parametrize("content, rule", [
    (b"\x01\x02", "too short for a safetensors header"),
    ((10**6).to_bytes(8, "little") + b"{}", "truncated or not safetensors"),
    ((4).to_bytes(8, "little") + b"[1]  ", "not a JSON object"),
    ((31).to_bytes(8, "little") + b'{"a": {"dtype": "F32", "x": 1}}', "malformed header entry"),
])
def test_a_file_whose_header_cannot_be_read_is_refused_naming_it(tmp_path, content, rule):
    folder = write_folder(tmp_path / "step-1")
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(IncompleteCheckpoint, match=rule) as refused:
        read_checkpoint(folder)
    assert str(refused.value.value).endswith("model.safetensors")


def test_a_staging_folder_is_refused_before_its_headers_are_read(tmp_path):
    folder = write_folder(tmp_path / ".version_00000003.tmp")
    (folder / "model.safetensors").write_bytes(b"half")
    with pytest.raises(IncompleteCheckpoint, match="staging folder"):
        read_checkpoint(folder)
    with pytest.raises(IncompleteCheckpoint, match="is not a folder"):
        read_checkpoint(tmp_path / "absent")


# -- the worker's controls and the driver's fan-out ------------------------------------------

class FolderTarget(DiskReloadTarget):
    """Checks folders as an engine does (the reader and the core's check) and records loads."""

    def __init__(self, metas=METAS, version=0):
        self.metas, self.version, self.loaded = metas, version, []

    def weight_version(self):
        return self.version

    async def check_checkpoint(self, path):
        return check_checkpoint(read_checkpoint(path), self.metas)

    async def reload_from_disk(self, path, *, mode=RefitMode.KEEP, version=None, deadline_s=None):
        await self.check_checkpoint(path)
        self.version = next_version(self.version, version)
        self.loaded.append((path, mode, deadline_s))
        return self.version

    def controls(self):
        async def weight_version(body):
            return {"weight_version": self.version}

        return {**WorkerDiskReload(self).controls(), "weight_version": weight_version}


def test_the_message_round_trips_and_refuses_bad_fields():
    reload = DiskReload("/ckpt/step-1", "drain", 3, 9.5)
    assert DiskReload.from_wire(reload.to_wire()) == reload
    assert DiskReload.from_wire({"path": "/x"}) == DiskReload("/x", RefitMode.KEEP)
    for body, field in [({}, "path"), ({"path": ""}, "path"), ({"path": "/x", "mode": "fast"}, "mode"),
                        ({"path": "/x", "weight_version": 0}, "weight_version"),
                        ({"path": "/x", "deadline_s": -1}, "deadline_s"),
                        ({"path": "/x", "extra": 1}, "reload_weights")]:
        with pytest.raises(InvalidValue) as refused:
            DiskReload.from_wire(body)
        assert refused.value.field == field


def test_a_worker_refuses_a_version_not_above_its_own_before_loading(tmp_path):
    folder = write_folder(tmp_path / "step-1")
    target = FolderTarget(version=4)
    worker = WorkerDiskReload(target)
    with pytest.raises(InvalidValue, match="weight_version"):
        asyncio.run(worker.reload_weights({"path": str(folder), "weight_version": 4}))
    assert target.loaded == []
    answer = asyncio.run(worker.reload_weights({"path": str(folder), "weight_version": 6}))
    assert answer["weight_version"] == 6 and target.loaded == [(str(folder), RefitMode.KEEP, None)]


def fleet(*targets):
    controls = [LocalWorkerControl(f"w{i}", t.controls()) for i, t in enumerate(targets)]
    return RefitCoordinator(controls, timeout_s=5.0)


def test_every_worker_reloads_at_the_fleets_next_version(tmp_path):
    folder = write_folder(tmp_path / "step-1")
    targets = (FolderTarget(version=2), FolderTarget(version=0))  # the second joined late
    coordinator = fleet(*targets)
    assert asyncio.run(coordinator.reload_weights(str(folder), deadline_s=10)) == {"w0": 3, "w1": 3}
    assert [t.loaded for t in targets] == [[(str(folder), RefitMode.KEEP, worker_deadline_s(10))]] * 2
    assert asyncio.run(coordinator.reload_weights(str(folder), mode="drain")) == {"w0": 4, "w1": 4}


def test_a_folder_one_worker_refuses_is_loaded_by_none(tmp_path):
    folder = write_folder(tmp_path / "step-1")
    picky = FolderTarget(metas={**METAS, "head.weight": TensorMeta("head.weight", (2,), "float32")})
    other = FolderTarget()
    with pytest.raises(WorkerFailures) as failed:
        asyncio.run(fleet(other, picky).reload_weights(str(folder)))
    assert failed.value.step == "check_checkpoint" and set(failed.value.failures) == {"w1"}
    assert "head.weight" in str(failed.value)
    assert other.loaded == picky.loaded == []


def test_an_engine_without_the_port_refuses_naming_its_kind():
    controls = refusing_disk_reload("memory")
    assert set(controls) == {"check_checkpoint", "reload_weights"}
    for handler in controls.values():
        with pytest.raises(NotImplementedError, match="the memory engine does not reload"):
            asyncio.run(handler({"path": "/x"}))


def test_the_worker_serves_the_refusal_for_a_memory_engine(tmp_path):
    from rollout_fleet.adapters.memory import MemoryEngine
    from rollout_fleet.wiring.worker import disk_reload_controls
    from rollout_fleet.wiring.worker_config import WorkerConfig

    config = WorkerConfig.from_mapping({"engine": {"kind": "memory"}, "served_model_name": "m",
                                         "run_dir": str(tmp_path)})
    controls = disk_reload_controls(MemoryEngine(seed=0), config)
    with pytest.raises(NotImplementedError, match="the memory engine"):
        asyncio.run(controls["reload_weights"]({"path": "/x"}))


def test_a_copy_of_a_good_folder_with_a_shard_gone_is_refused(tmp_path):
    folder = write_folder(tmp_path / "step-1", shards=2)
    broken = shutil.copytree(folder, tmp_path / "step-2")
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(IncompleteCheckpoint, match="model-00002-of-00002.safetensors"):
        check_checkpoint(read_checkpoint(broken), METAS)
