"""Llama model folders for the GPU tier, built where they run (the GPU machine downloads
nothing): random weights from a seed, a word-level tokenizer whose vocabulary is exactly the
model's (so any token the model samples decodes), a chat template for Dynamo's model card.

    LLAMA_1B: Llama-3.2-1B's shapes (16 layers, 2048 hidden, 32/8 heads, 8192 MLP, 128,256
              vocabulary, tied embedding), bf16 - the throughput model
    LLAMA_8B: Llama-3.1-8B's shapes (32 layers, 4096 hidden, 32/8 heads, 14336 MLP, 128,256
              vocabulary, untied), bf16 - the size RL runs
    SMALL:    4 layers, 256 hidden, 1,024 vocabulary - the fidelity model (float32 or bf16)
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA_1B = dict(vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                init_std=0.02)
LLAMA_8B = dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                init_std=0.02)
SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
             init_std=0.08)  # wide: greedy choices are rarely near-ties
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{{ eos_token }}{% endfor %}"
PAD, BOS, EOS = 0, 1, 2
PAD_TEXT = "<padding>"


def build_llama(folder: str | Path, shape: dict, dtype: str, seed: int = 0,
                max_positions: int = 2048) -> Path:
    """Write a model folder (config, safetensors in ``dtype``, tokenizer); same seed, same
    weights. Norm weights are ones; every other tensor is N(0, init_std)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(shape)
    std = shape.pop("init_std")
    config = LlamaConfig(**shape, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                         pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, dtype=dtype,
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(out)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in sorted(skeleton.state_dict().items()):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape)
        else:
            value = torch.randn(param.shape, generator=generator) * std
        weights[name] = value.to(getattr(torch, dtype)).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(out, shape["vocab_size"], max_positions)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}))
    return out


def _write_tokenizer(out: Path, vocab_size: int, max_positions: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # vLLM's server refuses a text prompt longer than its token budget times the vocabulary's
    # longest token, in characters; a word here costs its letters and a space, so one entry
    # must be longer than any word and its space: the pad token's name.
    vocab = {PAD_TEXT: PAD, "<s>": BOS, "</s>": EOS}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    if len(PAD_TEXT) < len(f"w{vocab_size - 1} "):
        raise ValueError(f"vocab_size={vocab_size}: its words outgrow the pad's name {PAD_TEXT!r}")
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=PAD_TEXT))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token=PAD_TEXT, model_max_length=max_positions)
    fast.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE  # Dynamo reads it from tokenizer_config.json only
    config_path.write_text(json.dumps(config, indent=2))


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]
