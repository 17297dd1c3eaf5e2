"""A staged row as the columns of one TransferQueue sample, in NeMo-RL's layout for token
capture's staging partition (the columns its ``TQTokenSource`` and finalizer read).

Three per-token columns, jagged across rows: ``token_ids_delta`` (int64), ``token_mask_delta``
and ``generation_logprobs_delta`` (float32, the digests' float32 bit patterns). Then one value
per row: the versions, the lengths, the weight version and the mode code (int64), the ids as
UTF-8 bytes (uint8, jagged; an absent parent as one NUL byte beside a presence flag), the four
digests as their 32 bytes (uint8), the chain and cumulative hashes each beside a presence flag
(bool). The extras columns say "none": JSON ``null``, route encoding 0, route length 0; the
compact-delta columns say "the same as the delta": one sentinel token and length 0.

TransferQueue keeps one dtype per column across rows, so every row written here uses the same
dtypes, NeMo-RL's.
"""

from __future__ import annotations

from typing import Any

from rollout_fleet.core.capture_admission import CaptureMode
from rollout_fleet.core.capture_records import ChainLink, StagedRow

MODE_CODES: dict[CaptureMode, int] = {"text": 0, "token_in": 1}
_MODES: dict[int, CaptureMode] = {code: mode for mode, code in MODE_CODES.items()}

# The columns of NeMo-RL's staging partition (its STAGING_FIELDS), as it registers them.
STAGING_COLUMNS = (
    "token_ids_delta", "token_mask_delta", "generation_logprobs_delta",
    "compact_token_ids_delta", "compact_len",
    "schema_version", "digest_version", "extras_digest_version",
    "rollout_id_utf8", "model_call_id_utf8", "parent_call_id_utf8", "parent_call_id_present",
    "capture_mode", "prev_len", "delta_len", "cum_len", "weight_version",
    "digest_bytes", "extras_digest_bytes", "chain_hash_bytes", "chain_hash_present",
    "cumulative_hash_bytes", "cumulative_hash_present",
    "extras_metadata_json", "routed_experts_encoding", "routed_len",
)
# What a prefix read needs: the deltas and the columns that place each row in its chain.
LINK_COLUMNS = (
    "token_ids_delta", "rollout_id_utf8", "model_call_id_utf8", "parent_call_id_utf8",
    "parent_call_id_present", "prev_len", "chain_hash_bytes", "chain_hash_present",
)
_INT_SCALARS = ("schema_version", "digest_version", "extras_digest_version", "prev_len",
                "delta_len", "cum_len", "weight_version")


def row_columns(row: StagedRow) -> dict[str, Any]:
    """``row`` as one sample's columns (each a tensor with a leading batch dimension of 1)."""
    import torch

    def scalar(value: int) -> Any:
        return torch.tensor([value], dtype=torch.int64)

    def raw(data: bytes) -> Any:
        return torch.tensor([list(data)], dtype=torch.uint8)

    def flag(value: bool) -> Any:
        return torch.tensor([value], dtype=torch.bool)

    return {
        "token_ids_delta": torch.tensor([list(row.token_ids_delta)], dtype=torch.int64),
        "token_mask_delta": torch.tensor([list(row.token_mask_delta)], dtype=torch.float32),
        "generation_logprobs_delta": torch.tensor([list(row.generation_logprobs_delta)],
                                                  dtype=torch.float32),
        "compact_token_ids_delta": torch.tensor([[0]], dtype=torch.int64),
        "compact_len": scalar(0),
        **{name: scalar(getattr(row, name)) for name in _INT_SCALARS},
        "capture_mode": scalar(MODE_CODES[row.mode]),
        "rollout_id_utf8": raw(row.rollout_id.encode("utf-8")),
        "model_call_id_utf8": raw(row.model_call_id.encode("utf-8")),
        "parent_call_id_utf8": raw((row.parent_call_id or "\0").encode("utf-8")),
        "parent_call_id_present": flag(row.parent_call_id is not None),
        "digest_bytes": raw(bytes.fromhex(row.digest)),
        "extras_digest_bytes": raw(bytes.fromhex(row.extras_digest)),
        "chain_hash_bytes": raw(bytes.fromhex(row.chain_hash)),
        "chain_hash_present": flag(True),
        "cumulative_hash_bytes": raw(bytes.fromhex(row.cumulative_hash)),
        "cumulative_hash_present": flag(True),
        "extras_metadata_json": raw(b"null"),
        "routed_experts_encoding": scalar(0),
        "routed_len": scalar(0),
    }


def row_tags(row: StagedRow) -> dict[str, Any]:
    """The tags NeMo-RL's sink puts beside a row (TransferQueue's ``kv_list`` shows them)."""
    return {"rollout_id": row.rollout_id, "model_call_id": row.model_call_id,
            "parent_call_id": row.parent_call_id, "prev_len": row.prev_len,
            "delta_len": row.delta_len, "cum_len": row.cum_len,
            "weight_version": row.weight_version, "digest": row.digest,
            "schema_version": row.schema_version}


class _Sample:
    """One sample of a batch read from TransferQueue, its columns as Python values."""

    def __init__(self, batch: Any, index: int) -> None:
        self._batch = batch
        self._index = index

    def values(self, name: str) -> list[Any]:
        return list(self._batch.get(name)[self._index].reshape(-1).tolist())

    def integer(self, name: str) -> int:
        (value,) = self.values(name)
        return int(value)

    def raw(self, name: str) -> bytes:
        return bytes(int(value) for value in self.values(name))

    def text(self, name: str) -> str:
        return self.raw(name).decode("utf-8")

    def digest(self, name: str) -> str:
        data = self.raw(name)
        if len(data) != 32:
            raise ValueError(f"column {name} holds {len(data)} bytes, not a SHA-256 digest")
        return data.hex()

    def present(self, name: str) -> bool:
        (value,) = self.values(name)
        return bool(value)

    def parent(self) -> str | None:
        return self.text("parent_call_id_utf8") if self.present("parent_call_id_present") \
            else None

    def chain_hash(self) -> str:
        if not self.present("chain_hash_present"):
            raise ValueError("the row has no chain hash")
        return self.digest("chain_hash_bytes")


def link_at(batch: Any, index: int) -> ChainLink:
    """The chain link of sample ``index`` of a batch read with (at least) ``LINK_COLUMNS``."""
    sample = _Sample(batch, index)
    return ChainLink(sample.text("rollout_id_utf8"), sample.text("model_call_id_utf8"),
                     sample.parent(), sample.integer("prev_len"),
                     tuple(int(t) for t in sample.values("token_ids_delta")),
                     sample.chain_hash())


def identity_at(batch: Any, index: int) -> str:
    """The staging key of sample ``index`` (``<rollout_id>/<model_call_id>``)."""
    sample = _Sample(batch, index)
    return f"{sample.text('rollout_id_utf8')}/{sample.text('model_call_id_utf8')}"


def row_at(batch: Any, index: int) -> StagedRow:
    """Sample ``index`` of a batch read with ``STAGING_COLUMNS``, as the row that was staged;
    a row whose stored lengths or mode disagree with its columns raises ValueError."""
    sample = _Sample(batch, index)
    mode = _MODES.get(sample.integer("capture_mode"))
    if mode is None:
        raise ValueError(f"capture_mode {sample.integer('capture_mode')} is neither 0 nor 1")
    if not sample.present("cumulative_hash_present"):
        raise ValueError("the row has no cumulative hash")
    row = StagedRow(
        rollout_id=sample.text("rollout_id_utf8"),
        model_call_id=sample.text("model_call_id_utf8"), parent_call_id=sample.parent(),
        mode=mode, prev_len=sample.integer("prev_len"),
        weight_version=sample.integer("weight_version"),
        token_ids_delta=tuple(int(t) for t in sample.values("token_ids_delta")),
        token_mask_delta=tuple(float(m) for m in sample.values("token_mask_delta")),
        generation_logprobs_delta=tuple(
            float(lp) for lp in sample.values("generation_logprobs_delta")),
        chain_hash=sample.chain_hash(), cumulative_hash=sample.digest("cumulative_hash_bytes"),
        digest=sample.digest("digest_bytes"), extras_digest=sample.digest("extras_digest_bytes"),
        schema_version=sample.integer("schema_version"),
        digest_version=sample.integer("digest_version"),
        extras_digest_version=sample.integer("extras_digest_version"))
    stored = (sample.integer("delta_len"), sample.integer("cum_len"))
    if stored != (row.delta_len, row.cum_len):
        raise ValueError(f"stored delta_len, cum_len {stored} disagree with the columns "
                         f"({row.delta_len}, {row.cum_len})")
    return row
