"""The control secret on its way to a worker's node, sealed for the supervising actor.

Arguments of Ray tasks travel through Ray (task specs, the object store) where other jobs on
the cluster may read them. So the driver never passes the secret itself: each supervisor makes
a key pair when it starts, hands out the public half, and the driver seals the secret for it
(X25519 key agreement with a one-time key, HKDF-SHA256, ChaCha20-Poly1305). Only that actor's
process can open it; it then writes the secret to its worker's standard input.
"""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_KEY_BYTES = 32
_NONCE_BYTES = 12
_CONTEXT = b"rollout-fleet control secret"


class SecretOpener:
    """Holds a private key that never leaves this process."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()

    def public_key(self) -> bytes:
        return _raw(self._key.public_key())

    def open(self, sealed: bytes) -> str:
        """The secret, or ``cryptography.exceptions.InvalidTag`` when not sealed for this key."""
        one_time, nonce, ciphertext = (sealed[:_KEY_BYTES], sealed[_KEY_BYTES:_KEY_BYTES + _NONCE_BYTES],
                                       sealed[_KEY_BYTES + _NONCE_BYTES:])
        key = _derive(self._key.exchange(X25519PublicKey.from_public_bytes(one_time)))
        return ChaCha20Poly1305(key).decrypt(nonce, ciphertext, one_time).decode()


def seal(secret: str, public_key: bytes) -> bytes:
    """``secret`` readable only by the holder of ``public_key``'s private half."""
    one_time = X25519PrivateKey.generate()
    one_time_public = _raw(one_time.public_key())
    key = _derive(one_time.exchange(X25519PublicKey.from_public_bytes(public_key)))
    nonce = os.urandom(_NONCE_BYTES)
    return one_time_public + nonce + ChaCha20Poly1305(key).encrypt(nonce, secret.encode(), one_time_public)


def _derive(shared: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_CONTEXT).derive(shared)


def _raw(public_key: X25519PublicKey) -> bytes:
    """A public key's 32 bytes as they travel."""
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
