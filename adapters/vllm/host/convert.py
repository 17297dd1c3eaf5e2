"""Between vLLM's types and the project's: sampling parameters for a request, and vLLM's
outputs as the engine port's values (a whole ``ServedRollout``, or one streamed
``RolloutPiece``: tokens, one logprob each, alternatives, per-token weight versions), the
engine's facts, and the vocabulary check of token IDs."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.core.errors import EngineError, EngineRejected
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout, Usage
from rollout_fleet.ports.engine import EngineFacts, RolloutPiece

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
                   "abort": FinishReason.ABORT}


def read_facts(engine: Any) -> EngineFacts:
    config = engine.vllm_config
    return EngineFacts(
        context_length=config.model_config.max_model_len,
        kv_block_size=config.cache_config.block_size,
        total_kv_blocks=config.cache_config.num_gpu_blocks,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
    )


def engine_dtype(engine: Any) -> str:
    return str(engine.model_config.dtype).removeprefix("torch.")


def to_sampling_params(sampling: SamplingSpec, max_new_tokens: int, stop_strings: Sequence[str],
                     top_logprobs: int = 0, stop_token_ids: Sequence[int] = (),
                     extra: Mapping[str, Any] | None = None, stream: bool = False,
                     logprobs: bool = True) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    extra = dict(extra or {})
    if extra.get("structured_outputs") is not None:  # checked by core.sampling
        extra["structured_outputs"] = StructuredOutputsParams(**extra["structured_outputs"])
    common = dict(max_tokens=max_new_tokens, stop=list(stop_strings) or None,
                  logprobs=top_logprobs if logprobs else None,  # None: vLLM computes none
                  stop_token_ids=list(stop_token_ids) or None,
                  detokenize=bool(stop_strings),  # text is only needed to find stop strings
                  output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                  # Built for this one request and never reused: vLLM may take it as it is
                  # instead of deep-copying it (measured: ~6% of the worker host's main thread).
                  skip_clone=True, **_flat_logprobs(), **extra)
    if sampling.greedy:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=0 if sampling.top_k == -1 else sampling.top_k,
                          seed=sampling.seed, **common)


@functools.cache
def _flat_logprobs() -> dict[str, bool]:
    """vLLM's flat logprobs where it offers them: a request's logprobs kept in a few flat lists
    rather than a dict and an object per token (bench/bench_logprobs_cost.py on the CPU: about a
    fifth less of the front CPU that the chosen tokens' logprobs cost; bench/RESULTS.md)."""
    from vllm import SamplingParams

    return {"flat_logprobs": True} if "flat_logprobs" in getattr(
        SamplingParams, "__struct_fields__", ()) else {}


def chosen_logprobs(steps: Any, token_ids: Sequence[int]) -> list[float]:
    """The chosen token's logprob at each step. vLLM's flat logprobs with one entry per step (no
    alternatives asked) already hold them as one list, in step order."""
    flat, flat_ids = getattr(steps, "logprobs", None), getattr(steps, "token_ids", None)
    if isinstance(flat, list) and len(flat) == len(token_ids) and flat_ids == list(token_ids):
        return list(flat)
    return [step[token].logprob for step, token in zip(steps, token_ids)]


def piece_of(output: Any, top_n: int = 0, with_logprobs: bool = True) -> RolloutPiece:
    """One DELTA output: the step's new tokens with their logprobs (and alternatives), or
    without logprobs when none were asked of vLLM."""
    completion = output.outputs[0]
    token_ids = tuple(completion.token_ids)
    steps = completion.logprobs or []
    if with_logprobs and len(steps) != len(token_ids):
        raise EngineError(f"vLLM returned {len(token_ids)} tokens but {len(steps)} logprobs "
                          f"for request {output.request_id!r}")
    reason = cached = runs = None
    if output.finished:
        reason = _FINISH_REASONS.get(completion.finish_reason)
        if reason is None:
            raise EngineError(f"vLLM ended request {output.request_id!r} with finish_reason="
                              f"{completion.finish_reason!r}")
        cached = getattr(output, "num_cached_tokens", None)
        spans = getattr(completion, "weight_versions", None)  # over every token, not the delta
        if spans:
            runs = _runs_of(spans)
    return RolloutPiece(token_ids, tuple(chosen_logprobs(steps, token_ids)),
                        reason, tuple(_top_of(step, top_n) for step in steps) if top_n else None,
                        cached_prompt_tokens=cached, weight_versions=runs)


def to_served(output: Any, prompt_len: int, version: int, top_n: int = 0,
              with_logprobs: bool = True) -> ServedRollout:
    completion = output.outputs[0]
    reason = _FINISH_REASONS.get(completion.finish_reason)
    if reason is None:
        raise EngineError(f"vLLM ended request {output.request_id!r} with finish_reason="
                          f"{completion.finish_reason!r}")
    token_ids = list(completion.token_ids)
    # An older vLLM has no per-token versions: every token is tagged with ``version``, exact
    # because such an engine accepts drain refits only (features.py).
    runs = _version_runs(getattr(completion, "weight_versions", None), len(token_ids), version)
    if not with_logprobs:  # none asked of vLLM
        return served_rollout(token_ids, None, reason, prompt_len, version, runs=runs)
    logprobs = completion.logprobs or []
    if len(logprobs) != len(token_ids):
        raise EngineError(f"vLLM returned {len(token_ids)} tokens but {len(logprobs)} logprobs "
                          f"for request {output.request_id!r}")
    chosen = chosen_logprobs(logprobs, token_ids)
    # Each step also holds the top_n most likely tokens (ranks 1..top_n; the chosen one may
    # rank lower and is in ``chosen``).
    tops = tuple(_top_of(step, top_n) for step in logprobs) if top_n else None
    return served_rollout(token_ids, chosen, reason, prompt_len, version, tops, runs)


def _top_of(step: Mapping[int, Any], top_n: int) -> tuple[tuple[int, float], ...]:
    ranked = sorted((entry.rank, token, entry.logprob) for token, entry in step.items()
                    if entry.rank is not None and entry.rank <= top_n)
    return tuple((token, logprob) for _rank, token, logprob in ranked)


def _version_runs(spans: Any, n_tokens: int, version: int) -> list[tuple[int, int]]:
    """vLLM's spans (``version`` label, ``[start, end)`` of the output tokens) as runs; without
    spans (no token carried a label) every token is tagged with the version at completion."""
    if not spans:
        return [(version, n_tokens)] if n_tokens else []
    runs = _runs_of(spans)
    if sum(n for _, n in runs) != n_tokens:
        raise EngineError(f"vLLM's weight-version spans {spans} do not cover {n_tokens} tokens")
    return list(runs)


def _runs_of(spans: Any) -> tuple[tuple[int, int], ...]:
    """vLLM's spans (``version`` label, ``[start, end)`` of the output tokens) as runs."""
    return tuple((int(span.version), span.end - span.start) for span in spans
                 if span.end > span.start)


def served_rollout(token_ids, logprobs, reason, prompt_len, version, tops=None, runs=None) -> ServedRollout:
    return ServedRollout(token_ids, logprobs, reason, Usage(prompt_len, len(token_ids)),
                         weight_version=version, top_logprobs=tops,
                         **({} if runs is None else {"weight_versions": runs}))


def check_vocabulary(field: str, token_ids: Sequence[int], vocab: int) -> None:
    """EngineRejected naming the first token ID outside the model's vocabulary, and its size
    (the IDs are ints, checked where they entered)."""
    for index, token in enumerate(token_ids):
        if not 0 <= token < vocab:
            raise EngineRejected(f"{field}[{index}]={token!r} is outside the model's vocabulary of"
                                 f" {vocab} tokens (IDs 0..{vocab - 1})")
