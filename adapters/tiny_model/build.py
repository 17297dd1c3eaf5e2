"""Build the tiny model folder: config.json, model.safetensors, tokenizer files, generation_config.json."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import attrs
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import check_int_at_least

PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # trained first, so their IDs are 0, 1, 2
CORPUS_FILE = "corpus.txt"
# Dynamo's frontend requires a chat template; a plain one: each message's text, then EOS.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{{ eos_token }}{% endfor %}"
# A tool-calling template in the Hermes style (Dynamo's and vLLM's ``hermes`` parser reads the
# model's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). Written for both Jinja
# engines that render it: Dynamo's (minijinja) and transformers' (jinja2).
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "{{ eos_token }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}<|assistant|>"
    "{%- if message['content'] %}{{ message['content'] }}{% endif %}"
    "{%- if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] }}}</tool_call>{% endfor %}{% endif %}{{ eos_token }}"
    "{%- else %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
# What JSON tool calls are written with; the shipped corpus is plain prose without them, so a
# tool-calling tokenizer gets them in its base alphabet (a model that cannot spell ``{`` can
# never make a parseable call, whatever structured decoding allows).
TOOL_ALPHABET = list('{}[]"<>/|_-0123456789')


@attrs.frozen
class TinyModelSpec:
    """Shape of the tiny model. head_dim = hidden / heads must stay >= 32 (vLLM's CPU attention)."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    num_layers: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    init_std: float = 0.08  # wider than the usual 0.02, so greedy choices are rarely near-ties
    # Tied: the output layer is the embedding (as Qwen2.5's small models); the checkpoint then
    # holds no lm_head.weight, while a trainer's state dict does.
    tie_word_embeddings: bool = False
    # A Hermes-style tool-calling chat template, and a tokenizer that can spell JSON.
    tool_calls: bool = False

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise InvalidValue("hidden_size / num_heads", f"{self.hidden_size}/{self.num_heads}",
                               "must divide evenly into a head_dim >= 32")
        if self.vocab_size < 300:
            raise InvalidValue("vocab_size", self.vocab_size, "must be >= 300 (256 bytes + merges)")


def corpus_text() -> str:
    return resources.files(__package__).joinpath(CORPUS_FILE).read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int, extra_alphabet: list[str] | None = None):
    """A byte-level BPE trained on the shipped corpus (deterministic: merges break ties by pair).

    The base alphabet is only the corpus's own characters (plain ASCII), not all 256 bytes:
    every token then decodes to whole characters, so text grows token by token the same way
    in an incremental detokenizer (stop strings) as in a one-shot decode.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
        initial_alphabet=extra_alphabet or [])
    tokenizer.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise InvalidValue("vocab_size", vocab_size,
                           f"the corpus only supports {tokenizer.get_vocab_size()} tokens")
    return tokenizer


def llama_config(spec: TinyModelSpec):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        torch_dtype="float32", architectures=["LlamaForCausalLM"])  # Dynamo's model card needs it


def tiny_state_dict(seed: int, spec: TinyModelSpec = TinyModelSpec()) -> dict:
    """The model's weights (HF checkpoint names, float32) drawn from ``seed``."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # names and shapes only; no allocation, no default init
        skeleton = LlamaForCausalLM(llama_config(spec))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in sorted(skeleton.state_dict().items()):
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue  # the embedding's, as save_pretrained writes a tied model
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(param.shape, dtype=torch.float32)
        else:
            weights[name] = torch.randn(param.shape, generator=generator,
                                        dtype=torch.float32) * spec.init_std
    return weights


def _add_chat_template(path: Path, template: str) -> None:
    # Dynamo reads the template from tokenizer_config.json only (transformers 5 writes a
    # separate chat_template.jinja), so it goes in here.
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tiny_model_folder(directory: str | os.PathLike, seed: int = 0) -> str:
    """The tiny model of ``seed`` in ``directory``, built there unless it already is (whoever
    hands the folder to workers builds it first, so that they do not race to write it)."""
    folder = Path(directory)
    if not (folder / "config.json").exists():
        build_tiny_model(folder, seed=seed)
    return str(folder)


def build_tiny_model(directory: str | os.PathLike, seed: int = 0,
                     spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model folder and return its path. Same seed, same bytes."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    check_int_at_least("seed", seed, 0)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    llama_config(spec).save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    save_file(tiny_state_dict(seed, spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size,
                                         TOOL_ALPHABET if spec.tool_calls else None),
        bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=spec.max_position_embeddings)
    tokenizer.save_pretrained(out)
    _add_chat_template(out / "tokenizer_config.json",
                       TOOL_CHAT_TEMPLATE if spec.tool_calls else CHAT_TEMPLATE)
    (out / "rollout_fleet_tiny_model.json").write_text(
        json.dumps({"seed": seed, **attrs.asdict(spec)}, indent=2, sort_keys=True) + "\n")
    return out
