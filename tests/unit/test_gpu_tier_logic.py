"""The GPU tier's own logic, run on the CPU: the model folders it builds load in transformers,
and the comparison to the first near-tie counts what it says (tests/support/gpu_fidelity.py)."""

from __future__ import annotations

import json

from tests.support.gpu_fidelity import Reference, agreement, reference_decode
from support.gpu_models import SMALL, build_llama, random_prompts


def test_a_built_model_decodes_and_agrees_with_itself(tmp_path):
    shape = {**SMALL, "num_hidden_layers": 1}
    folder = build_llama(tmp_path / "m", shape, "bfloat16", seed=0)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == SMALL["vocab_size"] and tokenizer.decode([5, 6]) == "w5 w6"
    prompts = random_prompts(3, 4, SMALL["vocab_size"], seed=1)
    refs = reference_decode(str(folder), prompts, 6, device="cpu", dtype="float32")
    answers = [(list(r.token_ids), list(r.logprobs)) for r in refs]
    result = agreement(answers, refs)
    assert (result.equal_to_first_near_tie, result.max_dlogprob) == (3, 0.0)
    assert all(len(r.token_ids) == len(r.gaps) and all(g >= 0 for g in r.gaps) for r in refs)


def test_agreement_stops_at_the_first_near_tie_and_counts_a_difference_before_it():
    ref = Reference((5, 6, 7), (-0.1, -0.2, -0.3), (0.5, 1e-5, 0.5))
    tie_cut = agreement([([5, 9, 9], [-0.1, -1.0, -1.0])], [ref])
    assert (tie_cut.equal_to_first_near_tie, tie_cut.near_ties, tie_cut.compared_tokens) == (1, 1, 1)
    early = agreement([([4, 6, 7], [-0.1, -0.2, -0.3])], [ref], near_tie=1e-6)
    assert early.equal_to_first_near_tie == 0 and early.compared_tokens == 0
    logprob_off = agreement([([5, 6, 7], [-0.1, -0.2, -0.35])], [ref], near_tie=1e-6)
    assert logprob_off.equal_to_first_near_tie == 1 and abs(logprob_off.max_dlogprob - 0.05) < 1e-9
    longer = agreement([([5, 6, 7, 8], [-0.1] * 4)], [ref], near_tie=1e-6)
    assert longer.equal_to_first_near_tie == 0


def test_vllms_server_takes_a_text_prompt_of_the_1b_models_longest_words_at_its_token_budget(tmp_path):
    """vLLM's server refuses, before tokenizing, a text prompt longer than its token budget
    times the vocabulary's longest token in characters; the 1B model's words (``w128255``) and
    their spaces must fit that bound, or `vllm bench serve` sees 400s at long prompts."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    from support.gpu_models import LLAMA_1B, build_llama

    shape = {**LLAMA_1B, "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 8,
             "num_attention_heads": 1, "num_key_value_heads": 1}
    folder = build_llama(tmp_path / "m", shape, "bfloat16", seed=0, max_positions=64)
    tokenizer = get_cached_tokenizer(AutoTokenizer.from_pretrained(folder))
    budget = 4096
    longest = [LLAMA_1B["vocab_size"] - 1] * budget
    text = tokenizer.decode(longest)
    assert len(tokenizer.encode(text, add_special_tokens=False)) == budget
    assert len(text) <= budget * tokenizer.max_chars_per_token, (
        len(text), tokenizer.max_chars_per_token)
