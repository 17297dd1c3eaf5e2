"""The demo's trainer: the tiny model in torch, a group-relative policy-gradient step.

This stands in for a real trainer (NeMo-RL's policy workers): it holds its own copy of the
policy, recomputes the logprobs of the fleet's tokens, and updates the weights that the fleet
then receives through a refit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs
import torch


@attrs.frozen
class Scored:
    """One rollout as the trainer sees it."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    fleet_logprobs: tuple[float, ...]
    reward: float
    versions: tuple[int, ...] = ()  # the weight version that sampled each token


class TargetTokenReward:
    """A verifiable reward: the fraction of generated tokens in a fixed target set."""

    def __init__(self, vocab_size: int, fraction: float = 0.125, seed: int = 0,
                 exclude: Sequence[int] = (0, 1, 2)) -> None:
        candidates = [t for t in range(vocab_size) if t not in set(exclude)]
        rng = random.Random(seed)
        self.targets = frozenset(rng.sample(candidates, max(1, int(len(candidates) * fraction))))

    def __call__(self, tokens: Sequence[int]) -> float:
        return sum(t in self.targets for t in tokens) / len(tokens) if tokens else 0.0


def group_advantages(rewards: Sequence[float], group_size: int) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation."""
    advantages = []
    for start in range(0, len(rewards), group_size):
        group = torch.tensor(rewards[start:start + group_size], dtype=torch.float64)
        std = group.std(unbiased=False)
        advantages += ((group - group.mean()) / (std + 1e-6)).tolist()
    return advantages


class PolicyTrainer:
    def __init__(self, model_dir: str, *, learning_rate: float = 3e-3, seed: int = 0,
                 device: str = "cpu", dtype: str = "float32") -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.device = torch.device(device)
        # The engine's dtype: a refit sends these tensors as they are.
        self.model = LlamaForCausalLM.from_pretrained(
            model_dir, torch_dtype=getattr(torch, dtype)).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=learning_rate)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        """The model's own parameters (a tied weight once), for a sender to hold in place."""
        return dict(self.model.named_parameters())

    def state_dict_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """NeMo-RL's refit info shape: name -> (shape, dtype)."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self.state_dict().items()}

    def token_logprobs(self, rollouts: Sequence[Scored], *, grad: bool = False) -> list[torch.Tensor]:
        """Each rollout's generated tokens' logprobs under the trainer's weights (float32)."""
        lengths = [len(r.prompt) + len(r.tokens) for r in rollouts]
        width = max(lengths)
        ids = torch.zeros((len(rollouts), width), dtype=torch.long)
        mask = torch.zeros((len(rollouts), width), dtype=torch.long)
        for row, r in enumerate(rollouts):
            sequence = list(r.prompt) + list(r.tokens)
            ids[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = 1
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=ids.to(self.device),
                                attention_mask=mask.to(self.device)).logits.float().cpu()
            logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for row, r in enumerate(rollouts):
            start = len(r.prompt) - 1  # the logits at position i predict token i + 1
            positions = torch.arange(start, start + len(r.tokens))
            targets = torch.tensor(r.tokens, dtype=torch.long)
            out.append(logprobs[row, positions, targets])
        return out

    def mismatch(self, rollouts: Sequence[Scored]) -> tuple[float, float]:
        """Mean and max |trainer logprob - fleet logprob| over every generated token."""
        diffs = [(mine - torch.tensor(r.fleet_logprobs)).abs()
                 for mine, r in zip(self.token_logprobs(rollouts), rollouts) if r.tokens]
        flat = torch.cat(diffs)
        return float(flat.mean()), float(flat.max())

    def step(self, rollouts: Sequence[Scored], group_size: int) -> float:
        """One policy-gradient step (on-policy: the importance ratio is 1). Returns the loss."""
        advantages = group_advantages([r.reward for r in rollouts], group_size)
        kept = [(r, a) for r, a in zip(rollouts, advantages) if r.tokens]
        logprobs = self.token_logprobs([r for r, _ in kept], grad=True)
        loss = -torch.stack([lp.mean() * a for lp, (_, a) in zip(logprobs, kept)]).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())
