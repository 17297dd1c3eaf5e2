"""Plain OpenAI completions (no rollout annotation) as the Dynamo adapter serves them: a
request's options checked against what the engine offers (one choice; an option the engine
cannot honour refused by name), its sampling, and the engine's pieces as OpenAI chunks (token
texts and logprobs when asked). The request helpers both kinds share are the adapter's."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
from dynamo.common.backend import GenerateChunk
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import SamplingSpec
from rollout_fleet.core.sampling import NEUTRAL_SAMPLING, extra_sampling
from rollout_fleet.core.validate import check_int_at_least
from rollout_fleet.ports.engine import EnginePort, RefitTarget, RolloutPiece

logger = logging.getLogger(__name__)

# Options of a plain request that the engine port has no way to honour: a non-null value is
# refused by name (a 400), so a client never gets an answer computed without them.
_UNOFFERED_SAMPLING = ("length_penalty",)


@attrs.frozen
class PlainOptions:
    """What an ordinary OpenAI request asks of the engine, checked against what it offers."""

    max_tokens: Any
    sampling: SamplingSpec
    stop_strings: tuple[str, ...]
    logprobs: int | None  # None: not asked; 0: the chosen token's; N: and the N most likely
    engine_keywords: dict[str, Any]

    @classmethod
    def of(cls, request: Mapping[str, Any], offered: frozenset[str],
           offered_sampling: frozenset[str] = frozenset()) -> "PlainOptions":
        options = request.get("sampling_options") or {}
        stop = request.get("stop_conditions") or {}
        output = request.get("output_options") or {}
        _refuse_unoffered(options, output)
        _refuse_choices(options)
        logprobs = output.get("logprobs")
        if logprobs is not None:
            check_int_at_least("logprobs", logprobs, 0)
        keywords: dict[str, Any] = {}
        if logprobs:
            keywords["top_logprobs"] = logprobs
        stop_ids = stop.get("stop_token_ids") or []
        if stop_ids:
            keywords["stop_token_ids"] = tuple(stop_ids)
        missing = sorted(set(keywords) - offered)
        if missing:
            asked = {"top_logprobs": "logprobs > 0 (top alternatives)",
                     "stop_token_ids": "stop_token_ids"}
            raise InvalidValue(asked[missing[0]], keywords[missing[0]],
                               "this worker's engine does not offer it")
        extra = _extra_sampling(request, options, stop)
        for name in sorted(set(extra) - offered_sampling):
            raise InvalidValue(name, extra[name], "not offered by this fleet's engine port")
        if extra:
            keywords["extra_sampling"] = extra
        return cls(stop.get("max_tokens"), _plain_sampling(options),
                   tuple(stop.get("stop") or ()), logprobs, keywords)


def _extra_sampling(request: Mapping[str, Any], options: Mapping[str, Any],
                    stop: Mapping[str, Any]) -> dict[str, Any]:
    """The non-neutral sampling options a request asks for, wherever the frontend put them
    (penalties, min_p and guided_decoding in sampling_options, min_tokens and ignore_eos in
    stop_conditions,
    allowed_token_ids passed through in extra_args.sampling_options)."""
    passed = (request.get("extra_args") or {}).get("sampling_options") or {}
    for name, value in passed.items():
        if name not in NEUTRAL_SAMPLING and value is not None:
            raise InvalidValue(name, value, "not offered by this fleet's engine port")
    values = {name: options.get(name) for name in NEUTRAL_SAMPLING}
    values["structured_outputs"] = options.get("guided_decoding")  # the frontend's name for it
    values.update({name: stop.get(name) for name in ("min_tokens", "ignore_eos")})
    values.update({name: value for name, value in passed.items() if value is not None})
    return extra_sampling(values)


def _refuse_choices(options: Mapping[str, Any]) -> None:
    """n > 1 is refused: Dynamo 1.6.1's frontend ends an answer at the first choice that
    finishes, so the other choices would come back cut short (checked with 1.6.1)."""
    for name in ("n", "best_of"):
        value = options.get(name)
        if value is not None and value != 1:
            raise InvalidValue(name, value, "this fleet answers one choice per request "
                               "(the frontend cuts the others short); send n requests instead")


def _refuse_unoffered(options: Mapping[str, Any], output: Mapping[str, Any]) -> None:
    for name in _UNOFFERED_SAMPLING:
        if options.get(name) is not None:
            raise InvalidValue(name, options[name], "not offered by this fleet's engine port")
    if options.get("use_beam_search"):
        raise InvalidValue("use_beam_search", True, "beam search is not offered")
    if output.get("prompt_logprobs") is not None:  # also how the frontend passes echo
        raise InvalidValue("echo / prompt_logprobs", output["prompt_logprobs"],
                           "the engine does not compute prompt logprobs")


def _plain_sampling(options: Mapping[str, Any]) -> SamplingSpec:
    temperature = options.get("temperature")
    if temperature is not None and temperature == 0:
        return SamplingSpec(greedy=True)
    top_k, top_p = options.get("top_k"), options.get("top_p")
    return SamplingSpec(
        greedy=False,
        temperature=1.0 if temperature is None else temperature,  # OpenAI's default
        top_p=1.0 if top_p is None else top_p,
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=options.get("seed"),
    )


class TokenTexts:
    """Token ID -> its text, for the alternatives in ``top_logprobs`` (the model folder's
    ``tokenizer.json``; None where there is none to read)."""

    def __init__(self, model_path: str) -> None:
        self._tokenizer = None
        try:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        except Exception as exc:  # no folder, no file, or no tokenizers library: no texts
            logger.info("no token texts for logprobs (%s: %s)", type(exc).__name__, exc)

    def __call__(self, token_id: int) -> str | None:
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def piece_chunks(piece: RolloutPiece, hidden: set[int], *, logprobs: bool = False,
                  texts: Callable[[int], str | None] | None = None) -> list[GenerateChunk]:
    """The chunk of a piece: its visible tokens (one engine step's, or several when the engine
    ran ahead of this loop), with their logprobs (and the top alternatives) when asked. Hidden
    stop tokens (EOS) are left out: the frontend ends a stream at one."""
    if not logprobs:  # the piece may carry no logprobs then (``with_logprobs=False``)
        shown_ids = [t for t in piece.token_ids if t not in hidden]
        return [{"token_ids": shown_ids, "index": 0}] if shown_ids else []
    steps = zip(piece.token_ids, piece.logprobs, piece.top_logprobs or ((),) * len(piece.token_ids))
    shown = [(t, lp, top) for t, lp, top in steps if t not in hidden]
    if not shown:
        return []
    chunk: GenerateChunk = {"token_ids": [t for t, _, _ in shown], "index": 0}
    chunk["log_probs"] = [lp for _, lp, _ in shown]
    chunk["top_logprobs"] = [[
        {"rank": rank, "token_id": alt, "token": texts(alt) if texts else None,
         "logprob": alt_logprob}
        for rank, (alt, alt_logprob) in enumerate(top, start=1)] for _, _, top in shown]
    return [chunk]


class GeneratedTurn:
    """Every token a plain request generated, the hidden stop tokens (EOS) among them, with
    their logprobs, and the engine's weight version when it ended with each token's version
    (run-length; where the engine tells none, every token has the version at the end; an
    engine that is never refit has none): the ``engine_data`` of a request with the
    turn-tokens annotation."""

    def __init__(self, engine: EnginePort) -> None:
        self._refit = engine if isinstance(engine, RefitTarget) else None
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.cached_prompt_tokens: int | None = None
        self.weight_versions: tuple[tuple[int, int], ...] | None = None

    def add(self, piece: RolloutPiece) -> None:
        self.token_ids += piece.token_ids
        self.log_probs += piece.logprobs or ()
        if piece.cached_prompt_tokens is not None:
            self.cached_prompt_tokens = piece.cached_prompt_tokens
        if piece.weight_versions is not None:
            self.weight_versions = piece.weight_versions

    def engine_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"token_ids": self.token_ids, "log_probs": self.log_probs}
        if self._refit is not None:
            version = data["weight_version"] = self._refit.weight_version()
            data["weight_versions"] = [list(run) for run in self._runs(version)]
        if self.cached_prompt_tokens is not None:
            data["cached_prompt_tokens"] = self.cached_prompt_tokens
        return data

    def _runs(self, version: int) -> tuple[tuple[int, int], ...]:
        runs = self.weight_versions
        if runs is not None and sum(n for _, n in runs) == len(self.token_ids):
            return runs
        return ((version, len(self.token_ids)),) if self.token_ids else ()
