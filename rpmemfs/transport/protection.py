"""Wire protection settings: whether a TCP connection's traffic is sealed (docs/wire.md).

Protection is the default on both ends. ``none`` is for a link the operator trusts (a
private back-to-back cable); it must be asked for on both ends, and an end that protects
refuses a peer that does not, with the reason (the handshake carries each end's choice, and
a change to it in transit fails the proofs).

An initiator's choice is configuration, passed to each connection it opens (tcp.connect's
``wire_protection``, or the transport it is built into: choose.transport_for): the global
``--wire-protection`` option of a command, and the mount option ``wire_protection=``, which a
mount daemon carries in its options (a global ``--wire-protection`` given to ``rpmemfs mount``
fills it in when the options leave it out).
"""

from __future__ import annotations

from rpmemfs.native import lib
from rpmemfs.transport.wire import Cipher

MODES = ("aead", "none")
DEFAULT = "aead"


def check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"wire protection must be {' or '.join(MODES)}, not {mode!r}")
    return mode


def protects(mode: str) -> bool:
    """Whether an initiator told ``mode`` protects its traffic; ValueError for a bad mode."""
    return check(mode) == "aead"


def has_aes() -> bool:
    """Whether this CPU has the AES instructions that make AES-256-GCM the fast choice:
    detected, never assumed (ChaCha20-Poly1305 is the faster one without them)."""
    return bool(lib.rpm_sec_has_aes())


def choose(initiator_has_aes: bool) -> Cipher:
    """The target's choice for a protected connection."""
    return Cipher.AES_256_GCM if initiator_has_aes and has_aes() else Cipher.CHACHA20_POLY1305
