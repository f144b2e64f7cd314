"""The handshake's cryptography (wire version 2, docs/wire.md): ephemeral X25519, the key
schedule, and the proofs of the token.

Each end sends a fresh X25519 public key (in the HELLO, and in the CHALLENGE). Everything
after comes from HKDF-SHA256 over the token *and* the X25519 shared secret, salted with the
transcript (the HELLO, the CHALLENGE header, the target's public key): the two proofs, and
one record key per direction (rpmem_sec.c seals the records). So a passive eavesdropper,
who cannot compute the shared secret, has nothing to test token guesses against; a peer
who changes a byte of the transcript (a role, a flag, the cipher the target chose) ends
with other proofs, which the other end refuses.

The two proofs carry different labels: without them a peer could reflect one end's proof
back to it on a second connection. X25519 and HKDF are the ``cryptography`` package's.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from rpmemfs.transport.wire import KEY_SIZE

_KEYS_INFO = b"rpmemfs wire v2 keys\x00"
_TARGET_LABEL = b"rpmemfs wire v2 target proof\x00"
_INITIATOR_LABEL = b"rpmemfs wire v2 initiator proof\x00"


class Ephemeral:
    """One connection's X25519 key pair: made fresh per connection, never stored."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def shared(self, peer_public: bytes) -> bytes:
        """The shared secret with ``peer_public``; ValueError for a key that is not one (a
        low-order point gives an all-zero secret, which cryptography refuses)."""
        if len(peer_public) != KEY_SIZE:
            raise ValueError("public key of the wrong size")
        return self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))


@dataclass(frozen=True, slots=True)
class Keys:
    target_proof: bytes
    initiator_proof: bytes
    initiator_to_target: bytes  # the record key of what the initiator sends
    target_to_initiator: bytes


def derive(token: bytes, shared: bytes, transcript: bytes) -> Keys:
    okm = HKDF(
        algorithm=hashes.SHA256(), length=4 * KEY_SIZE,
        salt=hashlib.sha256(transcript).digest(), info=_KEYS_INFO,
    ).derive(shared + token)
    parts = [okm[i : i + KEY_SIZE] for i in range(0, 4 * KEY_SIZE, KEY_SIZE)]
    return Keys(*parts)


def target_proof(keys: Keys, transcript: bytes) -> bytes:
    return hmac.new(keys.target_proof, _TARGET_LABEL + transcript, hashlib.sha256).digest()


def initiator_proof(keys: Keys, transcript: bytes) -> bytes:
    return hmac.new(keys.initiator_proof, _INITIATOR_LABEL + transcript, hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
