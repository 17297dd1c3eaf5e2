"""A captured turn as it is staged, the chain that gives a later turn its prefix, and the
commit coordinates a worker answers with (pure; NeMo-Gym's staging schema 2).

A turn's delta is what it adds to its trajectory: the prompt past the ``prev_len`` tokens
already staged, then the generated tokens; its mask is 0.0 on the prompt part and 1.0 on the
generated part, its logprobs 0.0 on the prompt part. Logprobs are held rounded to float32, as
the staged columns hold them, so a row read back equals the row staged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from rollout_fleet.core.capture_admission import (
    CaptureAdmission, CaptureMode, CaptureRefused, staging_key,
)
from rollout_fleet.core.capture_digest import (
    EMPTY_EXTRAS_DIGEST, EXTRAS_DIGEST_VERSION, STAGING_DIGEST_VERSION, STAGING_SCHEMA_VERSION,
    chain_hash, float32, is_digest, is_token_id, row_digest, tokens_hash,
)
from rollout_fleet.core.errors import InvalidValue, RolloutFleetError

Disposition = Literal["staged", "capture_failed"]


class StagingChainBroken(InvalidValue):
    """A staging chain cannot give the prefix it names: a row is missing or unreadable, or
    does not continue the row before it (names the key and its place in the chain)."""


class StagedRowMissing(StagingChainBroken):
    """Staging holds no row under a key (never staged, or cleared since)."""


class StagingUnavailable(RolloutFleetError):
    """The staging store could not be reached, or failed while answering."""


@attrs.frozen
class TurnDelta:
    token_ids: tuple[int, ...]
    token_mask: tuple[float, ...]
    logprobs: tuple[float, ...]


def turn_delta(prompt_token_ids: Sequence[int], generated_token_ids: Sequence[int],
               generated_logprobs: Sequence[float], prev_len: int) -> TurnDelta:
    """``prompt[prev_len:] + generated``, its mask and its logprobs (0.0 on the prompt)."""
    if not 0 <= prev_len <= len(prompt_token_ids):
        raise CaptureRefused("prompt_token_ids", f"{len(prompt_token_ids)} token IDs",
                             f"are fewer than prev_len={prev_len}")
    if len(generated_logprobs) != len(generated_token_ids):
        raise CaptureRefused("generated_logprobs", f"{len(generated_logprobs)} logprobs",
                             f"must be one per generated token ({len(generated_token_ids)})")
    carried = tuple(prompt_token_ids[prev_len:])
    token_ids = carried + tuple(generated_token_ids)
    if not token_ids:
        raise CaptureRefused("generated_token_ids", [], "a turn adds at least one token")
    logprobs = tuple(float32(value, "generated_logprobs") for value in generated_logprobs)
    return TurnDelta(token_ids, (0.0,) * len(carried) + (1.0,) * len(generated_token_ids),
                     (0.0,) * len(carried) + logprobs)


def _must(test: bool, field: str, value: Any, rule: str) -> None:
    if not test:
        raise InvalidValue(field, value, rule)


@attrs.frozen
class StagedRow:
    """One turn's delta, its lineage and its digests: what staging holds under
    ``staging_key``. Built checked (Gym's rules for a staged call); ``verify`` recomputes
    the digest, for a row read back."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: CaptureMode
    prev_len: int
    weight_version: int
    token_ids_delta: tuple[int, ...]
    token_mask_delta: tuple[float, ...]
    generation_logprobs_delta: tuple[float, ...]
    chain_hash: str
    cumulative_hash: str
    digest: str
    extras_digest: str = EMPTY_EXTRAS_DIGEST
    schema_version: int = STAGING_SCHEMA_VERSION
    digest_version: int = STAGING_DIGEST_VERSION
    extras_digest_version: int = EXTRAS_DIGEST_VERSION

    def __attrs_post_init__(self) -> None:
        versions = (self.schema_version, self.digest_version, self.extras_digest_version)
        _must(versions == (STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION,
                           EXTRAS_DIGEST_VERSION), "schema_version", versions,
              "must be staging schema 2, digest 2, extras digest 1")
        staging_key(self.rollout_id, self.model_call_id)
        root = self.parent_call_id is None
        _must(root == (self.prev_len == 0) == (self.mode == "text"), "parent_call_id",
              (self.parent_call_id, self.prev_len, self.mode),
              "a root has no parent, prev_len 0 and mode text; any other row all three else")
        _must(type(self.prev_len) is int and self.prev_len >= 0, "prev_len", self.prev_len,
              "must be an integer >= 0")
        _must(type(self.weight_version) is int and self.weight_version >= 0, "weight_version",
              self.weight_version, "must be an integer >= 0")
        self._check_columns()
        for name in ("chain_hash", "cumulative_hash", "digest", "extras_digest"):
            _must(is_digest(getattr(self, name)), name, getattr(self, name),
                  "must be a lowercase SHA-256 hex digest")

    def _check_columns(self) -> None:
        lengths = {len(self.token_ids_delta), len(self.token_mask_delta),
                   len(self.generation_logprobs_delta)}
        _must(len(lengths) == 1 and self.delta_len >= 1, "token_ids_delta", lengths,
              "the delta, its mask and its logprobs hold one entry per token, at least one")
        _must(all(is_token_id(t) for t in self.token_ids_delta), "token_ids_delta",
              self.token_ids_delta, "must be token IDs")
        _must(all(m in (0.0, 1.0) for m in self.token_mask_delta), "token_mask_delta",
              self.token_mask_delta, "holds only 0.0 (prompt) and 1.0 (generated)")
        _must(all(lp == 0.0 for m, lp in zip(self.token_mask_delta,
                                              self.generation_logprobs_delta) if m == 0.0),
              "generation_logprobs_delta", self.generation_logprobs_delta,
              "must be 0.0 on prompt tokens")

    @property
    def delta_len(self) -> int:
        return len(self.token_ids_delta)

    @property
    def cum_len(self) -> int:
        return self.prev_len + self.delta_len

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.model_call_id)

    def expected_digest(self) -> str:
        return row_digest(
            rollout_id=self.rollout_id, model_call_id=self.model_call_id,
            parent_call_id=self.parent_call_id, mode=self.mode,
            lengths=(self.prev_len, self.delta_len, self.cum_len),
            weight_version=self.weight_version, token_ids_delta=self.token_ids_delta,
            token_mask_delta=self.token_mask_delta,
            generation_logprobs_delta=self.generation_logprobs_delta,
            extras_digest=self.extras_digest, chain_hash=self.chain_hash,
            cumulative_hash=self.cumulative_hash)

    def verify(self) -> None:
        """Raise InvalidValue unless the digest is the one of the row's contents."""
        _must(self.digest == self.expected_digest(), "digest", self.digest,
              f"does not match the contents of row {self.staging_key!r}")

    def link(self) -> ChainLink:
        return ChainLink(self.rollout_id, self.model_call_id, self.parent_call_id,
                         self.prev_len, self.token_ids_delta, self.chain_hash)


def build_row(admission: CaptureAdmission, prefix: Sequence[int], weight_version: int,
              prompt_token_ids: Sequence[int], generated_token_ids: Sequence[int],
              generated_logprobs: Sequence[float]) -> StagedRow:
    """The row of one completed turn. A continuation's prompt must begin with ``prefix`` (the
    admitted one); anything else is refused (InvalidValue), never staged."""
    if admission.mode == "token_in" and tuple(prompt_token_ids[:admission.prev_len]) != \
            tuple(prefix):
        raise CaptureRefused("prompt_token_ids", f"{len(prompt_token_ids)} token IDs",
                             f"do not begin with the admitted prefix of {admission.prev_len}"
                             " tokens")
    delta = turn_delta(prompt_token_ids, generated_token_ids, generated_logprobs,
                       admission.prev_len)
    chain = chain_hash(admission.parent_chain_hash, delta.token_ids)
    cumulative = tokens_hash([*prompt_token_ids, *generated_token_ids])
    unsigned = StagedRow(
        rollout_id=admission.rollout_id, model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id, mode=admission.mode,
        prev_len=admission.prev_len, weight_version=weight_version,
        token_ids_delta=delta.token_ids, token_mask_delta=delta.token_mask,
        generation_logprobs_delta=delta.logprobs, chain_hash=chain, cumulative_hash=cumulative,
        digest="0" * 64)  # a placeholder: the digest covers every other field
    return attrs.evolve(unsigned, digest=unsigned.expected_digest())


@attrs.frozen
class ChainLink:
    """What a staged row tells of its place in a chain (the columns a prefix read needs)."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    prev_len: int
    token_ids_delta: tuple[int, ...]
    chain_hash: str

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.model_call_id)


def join_chain(keys: Sequence[str], links: Sequence[ChainLink],
               parent_chain_hash: str | None = None) -> list[int]:
    """The prefix a staging chain names: its rows' deltas, root first, after checking that
    each row is the one asked for and continues the row before it (same trajectory, its
    parent, the tokens so far, a chain hash recomputed from the deltas); and, given
    ``parent_chain_hash``, that the chain ends there."""
    if len(set(keys)) != len(keys):
        raise StagingChainBroken("staging_chain", list(keys), "names a row twice")
    if len(links) != len(keys):
        raise StagedRowMissing("staging_chain", list(keys), f"only {len(links)} rows were read")
    tokens: list[int] = []
    previous: ChainLink | None = None
    for index, (key, link) in enumerate(zip(keys, links)):
        broken = _chain_fault(key, link, previous, len(tokens))
        if broken:
            raise StagingChainBroken(f"staging_chain[{index}]", key, broken)
        tokens.extend(link.token_ids_delta)
        previous = link
    end = previous.chain_hash if previous else None
    if parent_chain_hash is not None and end != parent_chain_hash:
        raise StagingChainBroken("staging_chain", list(keys)[-1:], "ends at another chain hash"
                                 f" than the admission's parent_chain_hash ({end})")
    return tokens


def _chain_fault(key: str, link: ChainLink, previous: ChainLink | None, so_far: int) -> str:
    if link.staging_key != key:
        return f"holds the row of {link.staging_key!r}"
    if previous is None and link.parent_call_id is not None:
        return "is not a trajectory's root: a chain begins at the root"
    if previous is not None and (link.rollout_id, link.parent_call_id) != (
            previous.rollout_id, previous.model_call_id):
        return f"does not continue {previous.staging_key!r}, the row before it"
    if link.prev_len != so_far:
        return f"continues {link.prev_len} tokens; the rows before it hold {so_far}"
    if chain_hash(previous.chain_hash if previous else None,
                  link.token_ids_delta) != link.chain_hash:
        return "its tokens do not give its chain hash"
    return ""


_STAGED_ONLY = ("digest", "extras_digest", "staging_key", "chain_hash", "cumulative_hash")


@attrs.frozen
class CommitCoords:
    """What a worker answers a captured call with (``ng_commit_coords``): where its row is
    staged and the digests Gym records in its ledger, or ``capture_failed`` (no row; the
    completion itself still answers). ``failure`` says why, for the worker's log; it never
    goes on the wire."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    prev_len: int
    delta_len: int
    weight_version: int
    disposition: Disposition = "staged"
    digest: str | None = None
    extras_digest: str | None = None
    staging_key: str | None = None
    chain_hash: str | None = None
    cumulative_hash: str | None = None
    failure: str | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        for name in ("rollout_id", "model_call_id"):
            _must(isinstance(getattr(self, name), str) and getattr(self, name) != "", name,
                  getattr(self, name), "must be non-empty text")
        for name in ("prev_len", "delta_len", "weight_version"):
            _must(type(getattr(self, name)) is int and getattr(self, name) >= 0, name,
                  getattr(self, name), "must be an integer >= 0")
        _must((self.parent_call_id is None) == (self.prev_len == 0), "prev_len", self.prev_len,
              "is 0 exactly for a call without a parent")
        staged = [getattr(self, name) for name in _STAGED_ONLY]
        if self.disposition == "staged":
            _must(None not in staged and self.delta_len > 0, "disposition", self.disposition,
                  "staged coordinates carry a delta and every digest and key")
        else:
            _must(self.disposition == "capture_failed", "disposition", self.disposition,
                  "must be 'staged' or 'capture_failed'")
            _must(staged == [None] * 5 and self.delta_len == 0, "disposition",
                  self.disposition, "capture_failed coordinates carry no delta, digest or key")

    @property
    def cum_len(self) -> int:
        return self.prev_len + self.delta_len

    @classmethod
    def staged(cls, row: StagedRow) -> CommitCoords:
        return cls(row.rollout_id, row.model_call_id, row.parent_call_id, row.prev_len,
                   row.delta_len, row.weight_version, "staged", row.digest, row.extras_digest,
                   row.staging_key, row.chain_hash, row.cumulative_hash)

    @classmethod
    def capture_failed(cls, admission: CaptureAdmission, weight_version: int,
                       failure: str) -> CommitCoords:
        return cls(admission.rollout_id, admission.model_call_id, admission.parent_call_id,
                   admission.prev_len, 0, weight_version, "capture_failed", failure=failure)

    def to_wire(self) -> dict[str, Any]:
        """As Gym writes its ``CommitCoords`` (schema 2, ``model_dump(mode="json")``)."""
        return {"schema_version": STAGING_SCHEMA_VERSION,
                "digest_version": STAGING_DIGEST_VERSION,
                "extras_digest_version": EXTRAS_DIGEST_VERSION,
                "rollout_id": self.rollout_id, "model_call_id": self.model_call_id,
                "parent_call_id": self.parent_call_id, "prev_len": self.prev_len,
                "delta_len": self.delta_len, "cum_len": self.cum_len,
                "weight_version": self.weight_version, "disposition": self.disposition,
                **{name: getattr(self, name) for name in _STAGED_ONLY}}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CommitCoords:
        """Coordinates as ``to_wire`` writes them; the versions and ``cum_len`` checked."""
        fields: dict[str, Any] = {name: data.get(name) for name in (
            "rollout_id", "model_call_id", "parent_call_id", "prev_len", "delta_len",
            "weight_version", "disposition", *_STAGED_ONLY)}
        wire = cls(**fields)
        _must(wire.to_wire() == dict(data), "ng_commit_coords", data,
              "must be NeMo-Gym's CommitCoords of schema 2, exactly")
        return wire
