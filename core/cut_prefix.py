"""A captured call's generated prefix, cut at a checkpoint and continued after a restore (pure).

While a call decodes, its server keeps every generated token and logprob (``CutProgress``).
A cut stages what was generated since the call's last cut as one chunk (a row of its own,
under ``generation-cut/<checkpoint>/<rollout>/<call>/chunk-<n>``), and acknowledges the
call's whole prefix so far: every chunk's key, the token count and the prefix digest (the
digest of the row the call would stage had it ended there). Decoding goes on meanwhile.

A restored call names those chunks (``CutContinuation``); ``restored_prefix`` reads them back
checked (their weight versions never newer than the current one nor decreasing, their count
and their digest, recomputed over this request's prompt, as acknowledged), and the server
prompts the engine with the prompt followed by the prefix, for what is left of the budget.
The call's row then covers the whole generation, prefix and rest: nothing lost, nothing twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from rollout_fleet.core.capture_admission import CAPTURE_FIELD, CaptureAdmission, CaptureRefused
from rollout_fleet.core.capture_records import StagedRow, build_row
from rollout_fleet.core.generation_cut import CutContinuation

CUT_KEY_ROOT = "generation-cut"
_WHERE = f"{CAPTURE_FIELD}.generation_cut"


def chunk_row(call: CaptureAdmission, checkpoint_id: str, sequence: int,
              token_ids: Sequence[int], logprobs: Sequence[float],
              weight_version: int) -> StagedRow:
    """One cut's chunk of ``call``'s generation, as a row of its own: its generated tokens,
    their logprobs, under ``generation-cut/<checkpoint>/<rollout>/<call>/chunk-<n>``."""
    identity = CaptureAdmission(
        f"{CUT_KEY_ROOT}/{checkpoint_id}/{call.rollout_id}/{call.model_call_id}",
        f"chunk-{sequence}", "text")
    return build_row(identity, (), weight_version, (), token_ids, logprobs)


def prefix_digest(call: CaptureAdmission, prefix: Sequence[int], weight_version: int,
                  prompt: Sequence[int], generated: Sequence[int],
                  logprobs: Sequence[float]) -> str:
    """The digest of the row ``call`` would stage had its generation ended at ``generated``."""
    return build_row(call, prefix, weight_version, prompt, generated, logprobs).digest


@attrs.frozen
class RestoredPrefix:
    """A restored call's generated prefix: its tokens, their logprobs, the oldest weight
    version among them and the chunks that hold them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int
    staging_keys: tuple[str, ...]


def _refuse(name: str, value: object, rule: str) -> CaptureRefused:
    return CaptureRefused(f"{_WHERE}.{name}", value, rule)


def _generated(rows: Sequence[StagedRow], keys: Sequence[str]) -> tuple[list[int], list[float]]:
    """The generated tokens of the chunks (mask 1.0); only the first may lead with prompt
    tokens (a whole row taken for a prefix)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for index, row in enumerate(rows):
        for token, mask, logprob in zip(row.token_ids_delta, row.token_mask_delta,
                                        row.generation_logprobs_delta):
            if mask == 1.0:
                tokens.append(token)
                logprobs.append(logprob)
            elif index > 0 or tokens:
                raise _refuse(f"staging_keys[{index}]", keys[index],
                              "holds prompt tokens after generated ones")
    return tokens, logprobs


def restored_prefix(continuation: CutContinuation, admission: CaptureAdmission,
                    prefix: Sequence[int], prompt: Sequence[int], rows: Sequence[StagedRow],
                    current_version: int) -> RestoredPrefix:
    """The prefix ``continuation`` names, read from its chunks ``rows`` and checked against
    what the cut acknowledged; ``admission``, ``prefix`` and ``prompt`` are the restored
    call's (the same lineage and prompt as the call that was cut)."""
    if continuation.terminal_finish_reason is not None:
        raise _refuse("terminal_finish_reason", continuation.terminal_finish_reason,
                      "a finished generation is not continued here: this fleet cuts only "
                      "calls still decoding")
    keys = continuation.staging_keys
    tokens, logprobs = _generated(rows, keys)
    versions = [row.weight_version for row in rows]
    if versions != sorted(versions) or versions[-1] > current_version:
        raise _refuse("staging_keys", list(keys), f"their weight versions {versions} must not "
                      f"decrease nor pass the current one ({current_version})")
    if len(tokens) != continuation.prefix_token_count:
        raise _refuse("prefix_token_count", continuation.prefix_token_count,
                      f"the staged chunks hold {len(tokens)} generated tokens")
    if len(tokens) >= continuation.effective_output_limit:
        raise _refuse("effective_output_limit", continuation.effective_output_limit,
                      f"leaves nothing to generate after the {len(tokens)} restored tokens")
    source = attrs.evolve(admission, rollout_id=continuation.source_capture_key,
                          model_call_id=continuation.source_model_call_id)
    digest = prefix_digest(source, prefix, versions[0], prompt, tokens, logprobs)
    if digest != continuation.prefix_digest:
        raise _refuse("prefix_digest", continuation.prefix_digest,
                      f"the staged prefix and this request's prompt give {digest}: the call "
                      "restored is not the call that was cut")
    return RestoredPrefix(tuple(tokens), tuple(logprobs), versions[0], keys)


@attrs.frozen
class FrozenChunk:
    """What one cut takes of a live call: the tokens generated since its last cut (maybe
    none), and where its generated prefix then ends."""

    sequence: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    upto: int


class CutProgress:
    """A live call's generation as it streams (appended in order, never rewritten) and what
    its cuts made durable: the sealed length and the chunks' keys (a restored call's
    inherited first)."""

    def __init__(self, restored: RestoredPrefix | None = None) -> None:
        self.inherited = restored
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.sealed = 0
        self.staging_keys: list[str] = list(restored.staging_keys) if restored else []
        self.next_sequence = 0
        self.ended = False
        self.broken: str | None = None  # why this call's progress cannot be cut

    def observe(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(token_ids) != len(logprobs):
            self.broken = f"{len(token_ids)} tokens came with {len(logprobs)} logprobs"
            return
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)

    def freeze(self) -> FrozenChunk | None:
        """The chunk a cut stages now; None where the call cannot be cut (ended, its progress
        broken, nothing generated at all)."""
        upto = len(self.token_ids)
        if self.ended or self.broken is not None or self.generated_count(upto) == 0:
            return None
        return FrozenChunk(self.next_sequence, tuple(self.token_ids[self.sealed:upto]),
                           tuple(self.logprobs[self.sealed:upto]), upto)

    def seal(self, frozen: FrozenChunk, key: str | None) -> None:
        """The chunk is durable under ``key`` (None: it was empty; nothing was staged)."""
        self.sealed = frozen.upto
        if key is not None:
            self.staging_keys.append(key)
            self.next_sequence += 1

    def generated_count(self, upto: int) -> int:
        return len(self.inherited.token_ids if self.inherited else ()) + upto

    def generated(self, upto: int) -> tuple[list[int], list[float]]:
        """The call's whole generated prefix through ``upto`` of its own tokens."""
        inherited = self.inherited
        tokens = [*(inherited.token_ids if inherited else ()), *self.token_ids[:upto]]
        logprobs = [*(inherited.logprobs if inherited else ()), *self.logprobs[:upto]]
        return tokens, logprobs
