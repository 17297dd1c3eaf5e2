"""Greedy answers against a transformers reference, to the first near-tie.

A greedy answer may fairly part from the reference where the reference's two best tokens are
nearly tied (float32 rounding of two nearly equal logits may pick either): each prompt is
compared up to the first step whose top-2 logprob gap is under ``near_tie``, and only there.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Reference:
    """The reference decode of one prompt: tokens, each token's logprob, each step's top-2 gap."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    gaps: tuple[float, ...]


@attrs.frozen
class Agreement:
    prompts: int
    equal_to_first_near_tie: int
    compared_tokens: int
    near_ties: int  # prompts cut short by a near-tie
    max_dlogprob: float

    def line(self) -> str:
        return (f"{self.equal_to_first_near_tie} of {self.prompts} prompts equal to the first"
                f" near-tie ({self.near_ties} cut there), {self.compared_tokens} tokens compared,"
                f" max |dlogprob| {self.max_dlogprob:.2e}")


def agreement(answers: list[tuple[list[int], list[float]]], references: list[Reference],
              near_tie: float = 1e-3) -> Agreement:
    """``answers``: (token IDs, logprobs) per prompt, in the references' order."""
    equal = compared = ties = 0
    worst = 0.0
    for (tokens, logprobs), ref in zip(answers, references, strict=True):
        steps = next((i for i, gap in enumerate(ref.gaps) if gap < near_tie), len(ref.token_ids))
        ties += steps < len(ref.token_ids)
        same = list(tokens[:steps]) == list(ref.token_ids[:steps]) and (
            steps < len(ref.token_ids) or len(tokens) == len(ref.token_ids))
        equal += same
        agreeing = _common_prefix(tokens[:steps], ref.token_ids[:steps])
        compared += agreeing
        for step in range(agreeing):
            worst = max(worst, abs(logprobs[step] - ref.logprobs[step]))
    return Agreement(len(references), equal, compared, ties, worst)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reference_decode(model_dir: str, prompts: list[list[int]], new_tokens: int, *,
                     device: str = "cuda", dtype: str = "float32", eos: int = 2) -> list[Reference]:
    """transformers' greedy decode (prompts of one length, one batch), float32 matmuls in IEEE
    float32 (TF32 off), ending each answer at ``eos`` as vLLM does."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=eos, pad_token_id=0)
    logprobs = torch.stack(out.logits, 1).float().log_softmax(-1)  # batch x steps x vocab
    top2 = logprobs.topk(2, dim=-1).values
    generated = out.sequences[:, ids.shape[1]:]
    references = []
    for row in range(len(prompts)):
        tokens = generated[row].tolist()
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        chosen = logprobs[row, torch.arange(end), generated[row, :end]]
        references.append(Reference(tuple(tokens[:end]), tuple(chosen.tolist()),
                                    tuple((top2[row, :end, 0] - top2[row, :end, 1]).tolist())))
    del model
    return references
