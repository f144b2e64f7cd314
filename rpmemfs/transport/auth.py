"""Challenge-response proofs over a shared token (token files: transport/tokens.py).

Each side proves it knows the token by an HMAC over the other side's fresh nonce. The two
proofs carry different labels: without them a peer could open a second connection, offer the
target's own challenge as its nonce, and replay the answer (a reflection attack).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from rpmemfs.transport.wire import NONCE_SIZE

_TARGET_LABEL = b"rpmemfs wire v1 target proof\x00"
_INITIATOR_LABEL = b"rpmemfs wire v1 initiator proof\x00"


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def target_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, _TARGET_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def initiator_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, _INITIATOR_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
