"""The chosen tokens' logprobs read from vLLM's two containers: a dict per step, and the flat
lists the worker asks for where vLLM offers them (vLLM's own ``FlatLogprobs``, filled by its
own ``append``): the same values either way, alternatives included."""

from __future__ import annotations

import types

import pytest
import vllm.logprobs as vllm_logprobs

from rollout_fleet.adapters.vllm.host.convert import chosen_logprobs, piece_of, to_sampling_params, to_served
from rollout_fleet.core.rollout import SamplingSpec


def steps_of(entries: list[dict[int, tuple[float, int]]], flat: bool):
    """vLLM's container of per-step logprobs: token -> (logprob, rank) at each step."""
    container = vllm_logprobs.FlatLogprobs() if flat else []
    for step in entries:
        container.append({token: vllm_logprobs.Logprob(logprob, rank)
                          for token, (logprob, rank) in step.items()})
    return container


def output(token_ids, steps, finished=True):
    completion = types.SimpleNamespace(index=0, token_ids=token_ids, logprobs=steps,
                                       finish_reason="length" if finished else None)
    return types.SimpleNamespace(request_id="r1", outputs=[completion], finished=finished,
                                 num_cached_tokens=0)


CHOSEN_ONLY = [{5: (-0.5, 2)}, {6: (-0.25, 1)}, {7: (-1.5, 9)}]
# Alternatives asked (top 1): the chosen token first, then the most likely one.
WITH_TOP_1 = [{5: (-0.5, 2), 9: (-0.1, 1)}, {6: (-0.25, 1)}, {7: (-1.5, 9), 8: (-0.2, 1)}]


@pytest.mark.parametrize("flat", [False, True])
def test_the_chosen_tokens_logprobs_are_the_same_from_either_container(flat):
    served = to_served(output([5, 6, 7], steps_of(CHOSEN_ONLY, flat)), prompt_len=2, version=1)
    assert served.logprobs == (-0.5, -0.25, -1.5)
    piece = piece_of(output((5, 6, 7), steps_of(CHOSEN_ONLY, flat), finished=False))
    assert piece.logprobs == (-0.5, -0.25, -1.5)


@pytest.mark.parametrize("flat", [False, True])
def test_with_alternatives_each_step_gives_its_chosen_token_and_its_top_ones(flat):
    served = to_served(output([5, 6, 7], steps_of(WITH_TOP_1, flat)), prompt_len=2, version=1,
                       top_n=1)
    assert served.logprobs == (-0.5, -0.25, -1.5)
    assert served.top_logprobs == (((9, -0.1),), ((6, -0.25),), ((8, -0.2),))


def test_flat_lists_of_other_tokens_are_not_taken_for_the_chosen_ones():
    """One entry per step, but not the generated tokens' (a container out of step with its
    tokens): read step by step, which names the mismatch as vLLM's KeyError."""
    with pytest.raises(KeyError):
        chosen_logprobs(steps_of(CHOSEN_ONLY, flat=True), [5, 6, 8])


def test_the_worker_asks_this_vllm_for_flat_logprobs():
    params = to_sampling_params(SamplingSpec(greedy=False, temperature=1.0), 4, ())
    assert params.flat_logprobs is True and params.logprobs == 0
