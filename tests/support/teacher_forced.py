"""A transformers forward of one whole token sequence: the logprob the model gives each token
after the ones before it (the reference for a trajectory's per-turn logprobs)."""

from __future__ import annotations


def teacher_forced_logprobs(model_dir, tokens: list[int]) -> list[float]:
    """Position i (i >= 1): log p(tokens[i] | tokens[:i]), float32; position 0 has none: 0.0."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    picked = logits[:-1].log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]
