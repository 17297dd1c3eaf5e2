"""The digests of a captured turn, byte for byte as NeMo-Gym's token capture (staging schema 2)
computes them, so Gym's ledger and NeMo-RL's finalizer, which recompute them over the staged
row, accept what the fleet stages (pure).

Every hash is SHA-256 over a domain name followed by a length-delimited, big-endian encoding:

* a token list: its length, then each ID, each as an unsigned 64-bit integer;
* the cumulative hash: the ``prefix-v2`` domain over the token list of the whole sequence;
* the chain hash: the ``chain-v1`` domain over a presence byte (0 for a root; 1 followed by
  the parent's 32 digest bytes), then the token list of this turn's delta;
* the extras digest: the ``extras-v1`` domain over the extras version byte, then a typed
  encoding of a JSON-like value (one tag byte per value: N, B, I, F, S, L, D);
* the staged-row digest: the ``call-v2`` domain over the three version bytes, the identity
  texts (each as length + UTF-8), the optional parent (a presence byte), the mode, the four
  lengths, the token list, the mask and the logprobs (each list as length-delimited bytes,
  the floats as IEEE-754 float32 bit patterns), the 32 extras-digest bytes, and the chain and
  cumulative hashes, each behind a presence byte of 1.

Masks and logprobs are hashed as float32 because the staged columns hold float32: the digest
of the values a worker had and of the values a reader fetches back is the same.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence

from rollout_fleet.core.errors import InvalidValue

STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

_ROW_DOMAIN = b"nemo-gym-staging-call-v2"
_EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
_TOKENS_DOMAIN = b"nemo-gym-staging-prefix-v2"
_CHAIN_DOMAIN = b"nemo-gym-staging-chain-v1"
_HEX = frozenset("0123456789abcdef")
_UINT64_END = 2**64
_INT64_RANGE = range(-(2**63), 2**63)


def is_digest(value: object) -> bool:
    """Whether ``value`` is a lowercase SHA-256 hex digest (64 characters)."""
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def is_token_id(value: object) -> bool:
    """Whether ``value`` is a token ID the digests can encode: an int (not a bool) in
    [0, 2**64)."""
    return type(value) is int and 0 <= value < _UINT64_END


def float32(value: object, field: str) -> float:
    """``value`` (an int or a float, never a bool) rounded to the nearest float32, as the
    staged float32 columns hold it; a value that is not finite there is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidValue(field, value, "must be a finite number")
    try:
        if not math.isfinite(value):
            raise InvalidValue(field, value, "must be a finite number")
        packed = struct.pack(">f", value)
    except OverflowError:  # an int past a double's range, or a double past float32's
        raise InvalidValue(field, value, "is beyond float32's range") from None
    rounded: float = struct.unpack(">f", packed)[0]
    if not math.isfinite(rounded):
        raise InvalidValue(field, value, "is beyond float32's range")
    return rounded


def _uint64(value: int, field: str) -> bytes:
    if type(value) is not int or not 0 <= value < _UINT64_END:
        raise InvalidValue(field, value, "must be an unsigned 64-bit integer")
    return struct.pack(">Q", value)


def _delimited(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


def _text(value: str, field: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidValue(field, value, "must be text")
    return _delimited(value.encode("utf-8"))


def _token_list(token_ids: Sequence[int]) -> bytes:
    return _uint64(len(token_ids), "token count") + b"".join(
        _uint64(token_id, "token_id") for token_id in token_ids)


def _float32_list(values: Sequence[float], field: str) -> bytes:
    encoded = bytearray(_uint64(len(values), f"{field} length"))
    for value in values:
        encoded += struct.pack(">f", float32(value, field))
    return bytes(encoded)


def _digest_bytes(value: str | None, field: str) -> bytes:
    if value is None or not is_digest(value):
        raise InvalidValue(field, value, "must be a lowercase SHA-256 hex digest")
    return bytes.fromhex(value)


def tokens_hash(token_ids: Sequence[int]) -> str:
    """The cumulative hash: of one whole token sequence (a turn's prompt and generation)."""
    return hashlib.sha256(_TOKENS_DOMAIN + _token_list(token_ids)).hexdigest()


def chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """This turn's link in its trajectory's chain: the parent's chain hash (None at the root)
    followed by this turn's delta, so a reader checks continuity from the deltas alone."""
    marker = b"\x00" if parent_chain_hash is None else (
        b"\x01" + _digest_bytes(parent_chain_hash, "parent_chain_hash"))
    return hashlib.sha256(_CHAIN_DOMAIN + marker + _token_list(token_ids_delta)).hexdigest()


def _extra(value: object) -> bytes:
    # Exact types only (a bool is not taken for an int, nor a tuple for a list), as Gym does:
    # two runtimes must never pick different encodings for one value.
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"B\x01" if value else b"B\x00"
    if isinstance(value, int) and type(value) is int:
        if value not in _INT64_RANGE:
            raise InvalidValue("extras", value, "an integer must fit in 64 signed bits")
        return b"I" + struct.pack(">q", value)
    if isinstance(value, float) and type(value) is float:
        if not math.isfinite(value):
            raise InvalidValue("extras", value, "a float must be finite")
        return b"F" + struct.pack(">d", value)
    if isinstance(value, str) and type(value) is str:
        return b"S" + _text(value, "extras")
    if isinstance(value, list) and type(value) is list:
        return b"L" + _items(value)
    if isinstance(value, dict) and type(value) is dict:
        return b"D" + _entries(value)
    raise InvalidValue("extras", value, "holds only null, bool, int, float, str, list and "
                                        "string-keyed dict values")


def _items(values: list[object]) -> bytes:
    return _uint64(len(values), "extras list length") + b"".join(_extra(v) for v in values)


def _entries(mapping: dict[object, object]) -> bytes:
    if not all(type(key) is str for key in mapping):
        raise InvalidValue("extras", list(mapping), "a mapping's keys must be strings")
    keys = sorted(mapping, key=lambda key: str(key).encode("utf-8"))
    return _uint64(len(keys), "extras mapping length") + b"".join(
        _text(str(key), "extras key") + _extra(mapping[key]) for key in keys)


def extras_digest(extras: Mapping[str, object] | None) -> str:
    """The digest of a turn's extras (None: none), over their typed encoding."""
    value = None if extras is None else dict(extras)
    payload = struct.pack(">B", EXTRAS_DIGEST_VERSION) + _extra(value)
    return hashlib.sha256(_EXTRAS_DOMAIN + payload).hexdigest()


EMPTY_EXTRAS_DIGEST = extras_digest(None)


def row_digest(*, rollout_id: str, model_call_id: str, parent_call_id: str | None, mode: str,
               lengths: tuple[int, int, int], weight_version: int,
               token_ids_delta: Sequence[int], token_mask_delta: Sequence[float],
               generation_logprobs_delta: Sequence[float], extras_digest: str,
               chain_hash: str, cumulative_hash: str,
               schema_version: int = STAGING_SCHEMA_VERSION) -> str:
    """The digest of one staged row; ``lengths`` is (prev_len, delta_len, cum_len). The row's
    rules are checked where it is built (``core.capture_records.StagedRow``); this only
    encodes. ``schema_version`` is the first byte hashed (Gym's later schemas keep the
    layout and change only that byte)."""
    payload = bytearray(struct.pack(">BBB", schema_version, STAGING_DIGEST_VERSION,
                                    EXTRAS_DIGEST_VERSION))
    payload += _text(rollout_id, "rollout_id") + _text(model_call_id, "model_call_id")
    payload += b"\x00" if parent_call_id is None else b"\x01" + _text(parent_call_id,
                                                                      "parent_call_id")
    payload += _text(mode, "mode")
    payload += b"".join(_uint64(n, name) for n, name in _named(lengths, weight_version))
    payload += _delimited(_token_list(token_ids_delta))
    payload += _delimited(_float32_list(token_mask_delta, "token_mask_delta"))
    payload += _delimited(_float32_list(generation_logprobs_delta, "generation_logprobs_delta"))
    payload += _digest_bytes(extras_digest, "extras_digest")
    payload += b"\x01" + _digest_bytes(chain_hash, "chain_hash")
    payload += b"\x01" + _digest_bytes(cumulative_hash, "cumulative_hash")
    return hashlib.sha256(_ROW_DOMAIN + bytes(payload)).hexdigest()


def _named(lengths: tuple[int, int, int], weight_version: int) -> Iterable[tuple[int, str]]:
    return zip((*lengths, weight_version), ("prev_len", "delta_len", "cum_len", "weight_version"))
