"""The control secret sealed for one supervising actor: only that actor's key opens it, the
sealed bytes do not hold it, and a changed byte is detected."""

import os

import pytest
from cryptography.exceptions import InvalidTag

from rollout_fleet.adapters.ray.sealed import SecretOpener, seal


def test_only_the_actor_it_was_sealed_for_opens_it():
    secret = os.urandom(16).hex()
    actor, other = SecretOpener(), SecretOpener()
    sealed = seal(secret, actor.public_key())
    assert secret.encode() not in sealed and sealed != seal(secret, actor.public_key())
    assert actor.open(sealed) == secret
    with pytest.raises(InvalidTag):
        other.open(sealed)
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(InvalidTag):
        actor.open(tampered)
