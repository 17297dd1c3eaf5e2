"""A tiny Llama-style causal LM built locally from a seed: the embedded default model.

No hub access: the tokenizer is trained with the ``tokenizers`` library on text shipped in this
package, and the weights are drawn from a seeded generator. The same seed gives byte-identical
files, so tests can build two models and compare outputs against a plain transformers decode.
"""

from rollout_fleet.adapters.tiny_model.build import (
    TinyModelSpec,
    build_tiny_model,
    tiny_model_folder,
    tiny_state_dict,
)

__all__ = ["TinyModelSpec", "build_tiny_model", "tiny_model_folder", "tiny_state_dict"]
