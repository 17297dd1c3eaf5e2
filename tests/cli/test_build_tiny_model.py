"""`rollout-fleet build-tiny-model DIR --seed N` writes a model folder that loads and refits."""

from __future__ import annotations

import json

from tests.cli.conftest import run_cli


def test_build_tiny_model_writes_a_loadable_folder(tmp_path):
    folder = tmp_path / "tiny"
    result = run_cli("build-tiny-model", folder, "--seed", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]

    import torch
    from tokenizers import Tokenizer

    from rollout_fleet.wiring.cli_refit import load_checkpoint

    state = load_checkpoint(str(folder))  # what `refit --checkpoint` reads
    embed = state["model.embed_tokens.weight"]
    assert list(embed.shape) == [config["vocab_size"], config["hidden_size"]]
    assert all(t.dtype == torch.float32 for t in state.values())
    layers = {name.split(".")[2] for name in state if name.startswith("model.layers.")}
    assert len(layers) == config["num_hidden_layers"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
