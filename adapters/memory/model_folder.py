"""A model folder for the MemoryEngine, so a serving runtime (Dynamo) can register it.

Dynamo's registration reads a Hugging Face style folder: ``config.json`` (context length, EOS),
``tokenizer.json`` (the frontend tokenizes text prompts and detokenizes the answer),
``tokenizer_config.json`` and ``generation_config.json``. The tokenizer's vocabulary is exactly
the MemoryEngine's ``VOCAB``, so token ID ``i`` decodes to ``VOCAB[i]`` and ID 0 is EOS.

Written with plain ``json``: the folder needs no ``tokenizers`` or ``transformers`` install.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from rollout_fleet.adapters.memory.model import EOS_TOKEN_ID, VOCAB

EOS_TOKEN = VOCAB[EOS_TOKEN_ID]
# A chat template so /v1/chat/completions works too: the turns joined by newlines.
_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def write_model_folder(folder: str | Path, *, context_length: int = 256) -> Path:
    """Write (or overwrite) the MemoryEngine's model folder; returns its path."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": _model_config(context_length),
        "generation_config.json": {"eos_token_id": EOS_TOKEN_ID, "bos_token_id": EOS_TOKEN_ID},
        "tokenizer.json": _tokenizer(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "bos_token": EOS_TOKEN,
            "unk_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "model_max_length": context_length,
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_template": _CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN,
                                    "unk_token": EOS_TOKEN, "pad_token": EOS_TOKEN},
    }
    for name, content in files.items():
        # Write then rename: several workers may write the same folder while others read it.
        staged = path / f".{name}.{os.getpid()}.tmp"
        staged.write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")
        os.replace(staged, path / name)
    return path


def _model_config(context_length: int) -> dict:
    # A Llama-shaped config: the fields a runtime reads (vocab, context, EOS); no weights exist.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(VOCAB),
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "intermediate_size": 8,
        "max_position_embeddings": context_length,
        "eos_token_id": EOS_TOKEN_ID,
        "bos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
    }


def _tokenizer() -> dict:
    """A WordLevel tokenizer over VOCAB: longest pieces first, then single characters."""
    pieces = sorted((t for t in VOCAB if t != EOS_TOKEN), key=len, reverse=True)
    split_pattern = "|".join(re.escape(p) for p in pieces)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{
            "id": EOS_TOKEN_ID, "content": EOS_TOKEN, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        }],
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": split_pattern},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        # Fuse joins the pieces with nothing between them (the default would add spaces).
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "WordLevel",
            "vocab": {token: index for index, token in enumerate(VOCAB)},
            "unk_token": EOS_TOKEN,
        },
    }
