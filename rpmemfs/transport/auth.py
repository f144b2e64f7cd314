"""Challenge-response proofs over a shared token, and reading the token file.

Each side proves it knows the token by an HMAC over the other side's fresh nonce. The two
proofs carry different labels: without them a peer could open a second connection, offer the
target's own challenge as its nonce, and replay the answer (a reflection attack).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from rpmemfs.transport.base import TransportError
from rpmemfs.transport.wire import NONCE_SIZE

_TARGET_LABEL = b"rpmemfs wire v1 target proof\x00"
_INITIATOR_LABEL = b"rpmemfs wire v1 initiator proof\x00"
MAX_TOKEN_FILE = 4096


class TokenError(TransportError):
    """The token file cannot be used; the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def target_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, _TARGET_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def initiator_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, _INITIATOR_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def read_token_file(path: str) -> bytes:
    """The token in ``path``: its bytes with surrounding whitespace stripped, never empty."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"token file {path} is not a regular file")
        if st.st_size > MAX_TOKEN_FILE:
            raise TokenError(f"token file {path} is larger than {MAX_TOKEN_FILE} bytes")
        with open(path, "rb") as f:
            token = f.read(MAX_TOKEN_FILE).strip()
    except OSError as exc:
        raise TokenError(f"cannot read token file {path}: {exc.strerror}") from exc
    if not token:
        raise TokenError(f"token file {path} is empty")
    return token
