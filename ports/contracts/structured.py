"""The engine contract's probe of ``structured_outputs`` (core/sampling.py): kept beside the
engine contract's other probes, which its table names."""

from __future__ import annotations

from rollout_fleet.core.rollout import GREEDY, FinishReason
from rollout_fleet.ports.contracts.harness import EngineUnderTest

ONLY_CHOICE = "a"  # one letter: every tokenizer spells it


def probe_structured_outputs(eut: EngineUnderTest) -> None:
    """Held to one choice of one letter, a generation with room for 32 tokens spells it and
    ends by itself (its end-of-sequence token), whatever the prompt."""
    for prompt in eut.prompts[:2]:
        served = eut.serve_offered(
            prompt, 32, GREEDY, extra_sampling={"structured_outputs": {"choice": [ONLY_CHOICE]}})
        assert served.finish_reason is FinishReason.STOP, served
        assert 1 <= len(served.token_ids) <= 2, served  # the letter, then end-of-sequence
