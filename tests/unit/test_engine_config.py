"""An engine's options and its model folder are checked when the fleet config is loaded: a bad
one is refused in one line naming the file, the field and the value, before anything starts."""

from __future__ import annotations

import json

import pytest

from rollout_fleet.adapters.memory.config import MemoryEngineConfig
from rollout_fleet.adapters.tiny_model import build_tiny_model
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.wiring.config import ConfigError, load_config


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def refused(tmp_path, config: dict) -> str:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def test_a_misspelt_vllm_option_is_refused_by_name(tmp_path):
    message = refused(tmp_path, {"engine": {"kind": "vllm", "enforce_eagr": True}})
    assert "engine.enforce_eagr" in message and "True" in message and "enforce_eager" in message


def test_a_bad_vllm_value_is_refused_by_name(tmp_path):
    message = refused(tmp_path, {"engine": {"kind": "vllm", "max_num_seqs": 0}})
    assert "engine.max_num_seqs" in message and "(got 0)" in message


@pytest.mark.parametrize("problem", ["missing", "a file", "no config", "no weights"])
def test_a_model_that_is_not_a_model_folder_is_refused(tmp_path, model_folder, problem):
    folder = tmp_path / "model"
    if problem == "a file":
        folder.write_text("not a folder")
    elif problem == "no config":
        folder.mkdir()
        (folder / "model.safetensors").write_bytes((model_folder / "model.safetensors").read_bytes())
    elif problem == "no weights":
        folder.mkdir()
        (folder / "config.json").write_text((model_folder / "config.json").read_text())
    message = refused(tmp_path, {"engine": {"kind": "vllm"}, "model": str(folder)})
    assert "model:" in message and str(folder) in message
    want = {"missing": "does not exist", "a file": "is not a folder", "no config": "config.json",
            "no weights": "no weights"}[problem]
    assert want in message


def test_a_model_folder_given_as_an_engine_option_is_checked_too(tmp_path):
    message = refused(tmp_path, {"engine": {"kind": "vllm", "model": str(tmp_path / "nowhere")}})
    assert "engine.model" in message and "does not exist" in message


def test_a_real_model_folder_loads(tmp_path, model_folder):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"engine": {"kind": "vllm", "max_num_seqs": 8}, "model": str(model_folder)}))
    assert load_config(path).model == str(model_folder)


@pytest.mark.parametrize("options, field", [
    ({"no_such_option": 1}, "engine.no_such_option"), ({"token_delay_s": -1}, "engine.token_delay_s"),
    ({"context_length": 1}, "engine.context_length"), ({"seed": "zero"}, "engine.seed"),
])
def test_a_bad_memory_option_is_refused_by_name(tmp_path, options, field):
    message = refused(tmp_path, {"engine": {"kind": "memory", **options}})
    assert f"{field}:" in message, message


def test_an_unknown_engine_kind_is_refused(tmp_path):
    message = refused(tmp_path, {"engine": {"kind": "sglang"}})
    assert "engine.kind" in message and "memory, vllm" in message


def test_the_memory_config_builds_the_engine_it_describes():
    engine = MemoryEngineConfig(seed=3, context_length=64, token_delay_s=0.5).engine()
    assert (engine.context_length, engine.token_delay_s) == (64, 0.5)
    with pytest.raises(InvalidValue, match="kv_block_size"):
        MemoryEngineConfig(kv_block_size=0)


def test_the_vllm_kinds_tiny_model_follows_tiny_model_seed(tmp_path):
    """model = "tiny": the fleet's model folder is the tiny Llama of the engine's seed, built
    once; an engine that names its own model folder is served from that folder."""
    import json

    from rollout_fleet.wiring.engines import EngineChoice

    def folder(table, run_dir):
        return EngineChoice.parse({"kind": "vllm", **table}, None).model_folder(run_dir)

    seed_3 = folder({"tiny_model_seed": 3}, tmp_path)
    assert seed_3.endswith("model-tiny-3") and json.loads(
        (tmp_path / "model-tiny-3" / "config.json").read_text())["model_type"] == "llama"
    assert folder({"tiny_model_seed": 3}, tmp_path) == seed_3  # built once
    assert folder({"model": seed_3}, tmp_path / "elsewhere") == seed_3


def test_the_engines_context_is_the_fleets_and_never_less(tmp_path):
    """The driver admits a rollout by the fleet's max_model_len: an engine with a shorter
    context would refuse rollouts the driver sent; unset, the engine takes the fleet's."""
    from rollout_fleet.wiring.config import fleet_facts

    message = refused(tmp_path, {"engine": {"kind": "vllm", "max_model_len": 256},
                                 "max_model_len": 1024})
    assert "engine.max_model_len" in message and "(got 256)" in message and "1024" in message
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"engine": {"kind": "vllm"}, "max_model_len": 1024}))
    config = load_config(path)
    options = config.engine_choice.worker_table(fleet_facts(config), slot=0, free_port=lambda: 0)
    assert options["max_model_len"] == 1024
    path.write_text(json.dumps({"engine": {"kind": "vllm", "max_model_len": 2048},
                                "max_model_len": 1024}))
    assert load_config(path).engine["max_model_len"] == 2048
