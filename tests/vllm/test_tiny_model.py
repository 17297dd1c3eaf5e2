"""The tiny-model builder: deterministic per seed, loadable by transformers, fast."""

import hashlib
import subprocess
import sys

import pytest

from rollout_fleet.adapters.tiny_model import TinyModelSpec, build_tiny_model
from rollout_fleet.core.errors import InvalidValue

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")


def _hashes(folder):
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


def test_same_seed_gives_identical_files(tmp_path, tiny_models):
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _hashes(again) == _hashes(tiny_models[0])


def test_another_seed_changes_the_weights_only(tiny_models):
    first, second = _hashes(tiny_models[0]), _hashes(tiny_models[1])
    assert first["model.safetensors"] != second["model.safetensors"]
    assert {k: v for k, v in first.items() if k != "model.safetensors"} == \
        {k: v for k, v in second.items() if k != "model.safetensors"}


def test_the_command_writes_the_same_folder(tmp_path, tiny_models):
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "rollout_fleet.adapters.tiny_model", str(out),
                           "--seed", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _hashes(out) == _hashes(tiny_models[1])


def test_transformers_loads_it_and_the_tokenizer_round_trips(tiny_models, tokenizer):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_models[0], dtype=torch.float32)
    assert model.config.head_dim >= 32 and model.config.vocab_size == tokenizer.get_vocab_size()
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_models[0])
    assert hf_tokenizer.eos_token_id == 2 and hf_tokenizer.bos_token_id == 1
    text = "The keeper counted the steps, one hundred and twelve."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_a_head_dim_below_32_is_refused():
    with pytest.raises(InvalidValue, match="head_dim"):
        TinyModelSpec(hidden_size=64, num_heads=4)
