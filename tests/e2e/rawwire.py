"""Wire version 2 spoken by hand, for tests that play an initiator or a target themselves.

The record layer here is written again in Python over ``cryptography``'s AEADs, apart from
the one the product uses (native/rpmem_sec.c): a test peer that talks to a real target or
initiator this way also checks that the product seals and opens records as docs/wire.md says.
"""

from __future__ import annotations

import hashlib
import socket
import struct
from collections.abc import Callable

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from rpmemfs.transport import auth
from rpmemfs.transport.tokens import key_id
from rpmemfs.transport.wire import (
    HEADER_SIZE,
    HELLO_F_PLAIN,
    KEY_SIZE,
    PROOF_SIZE,
    RECORD_LEN_SIZE,
    RECORD_MAX,
    RECORD_TAG_SIZE,
    VERSION,
    Cipher,
    Frame,
    Hello,
    Op,
    Role,
    unpack_header,
)

_LEN = struct.Struct("<I")


class Records:
    """One connection's record layer, both directions."""

    def __init__(self, cipher: Cipher, tx_key: bytes, rx_key: bytes) -> None:
        make = AESGCM if cipher == Cipher.AES_256_GCM else ChaCha20Poly1305
        self._tx, self._rx = make(tx_key), make(rx_key)
        self.tx_seq = self.rx_seq = 0
        self._raw = b""

    @staticmethod
    def _nonce(seq: int) -> bytes:
        return struct.pack("<Q", seq) + bytes(4)

    def seal(self, data: bytes) -> bytes:
        out = []
        for pos in range(0, len(data), RECORD_MAX):
            chunk = data[pos : pos + RECORD_MAX]
            head = _LEN.pack(len(chunk))
            out.append(head + self._tx.encrypt(self._nonce(self.tx_seq), chunk, head))
            self.tx_seq += 1
        return b"".join(out)

    def feed(self, raw: bytes) -> bytes:
        """The plaintext of the whole records ``raw`` completes (InvalidTag for a bad one)."""
        self._raw += raw
        out = []
        while len(self._raw) >= RECORD_LEN_SIZE:
            (n,) = _LEN.unpack_from(self._raw)
            whole = RECORD_LEN_SIZE + n + RECORD_TAG_SIZE
            if len(self._raw) < whole:
                break
            head, body = self._raw[:RECORD_LEN_SIZE], self._raw[RECORD_LEN_SIZE:whole]
            out.append(self._rx.decrypt(self._nonce(self.rx_seq), body, head))
            self.rx_seq += 1
            self._raw = self._raw[whole:]
        return b"".join(out)


def hello(role: Role, session_id: bytes, protect: bool = True, flags: int = 0
          ) -> tuple[auth.Ephemeral, bytes]:
    mine = auth.Ephemeral()
    flags |= 0 if protect else HELLO_F_PLAIN
    return mine, Hello(VERSION, role, mine.public, session_id, flags).pack()


def answer_challenge(token: bytes, mine: auth.Ephemeral, raw_hello: bytes, challenge: Frame,
                     payload: bytes, proof: Callable[[auth.Keys, bytes], bytes] = auth.initiator_proof
                     ) -> tuple[bytes, Records | None, bool]:
    """As an initiator: the AUTH frame, the record layer (None unprotected), and whether
    the target's proof held."""
    theirs = payload[:KEY_SIZE]
    transcript = raw_hello + challenge.pack() + theirs
    keys = auth.derive(token, mine.shared(theirs), transcript)
    genuine = auth.same(payload[KEY_SIZE:], auth.target_proof(keys, transcript))
    cipher = Cipher(challenge.imm)
    records = None if cipher == Cipher.NONE else Records(cipher, keys.initiator_to_target,
                                                          keys.target_to_initiator)
    return Frame(Op.AUTH, length=PROOF_SIZE).pack() + proof(keys, transcript), records, genuine


def challenge_for(token: bytes, raw_hello: bytes, cipher: Cipher = Cipher.AES_256_GCM
                  ) -> tuple[bytes, Records | None]:
    """As a target: the CHALLENGE (header and payload) for ``raw_hello``, and the record
    layer to use once the initiator's AUTH came (None for Cipher.NONE)."""
    mine = auth.Ephemeral()
    header = Frame(Op.CHALLENGE, length=KEY_SIZE + PROOF_SIZE, imm=cipher).pack()
    transcript = raw_hello + header + mine.public
    keys = auth.derive(token, mine.shared(Hello.unpack(raw_hello).public), transcript)
    records = None if cipher == Cipher.NONE else Records(cipher, keys.target_to_initiator,
                                                          keys.initiator_to_target)
    return header + mine.public + auth.target_proof(keys, transcript), records


def read_frame(sock: socket.socket, records: Records | None = None) -> tuple[Frame, bytes]:
    """One frame from a blocking socket, opened from records when ``records`` is given (bytes
    after it are not kept: for a peer that reads one answer). EOFError if it closes first."""
    got = b""
    while len(got) < HEADER_SIZE or len(got) < HEADER_SIZE + unpack_header(got).length:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(f"closed after {len(got)} bytes of a frame")
        got += records.feed(chunk) if records is not None else chunk
    frame = unpack_header(got)
    return frame, got[HEADER_SIZE : HEADER_SIZE + frame.length]


def authenticate(sock: socket.socket, token: bytes) -> tuple[Frame, bytes]:
    """A control connection's handshake by hand on a connected blocking socket: the target's
    answer, its OK (the payload: session id and info) or its ERROR (the payload: why)."""
    mine, raw = hello(Role.CONTROL, key_id(token))
    sock.sendall(raw)
    frame, payload = read_frame(sock)
    if frame.op != Op.CHALLENGE:
        return frame, payload
    answer, records, _ = answer_challenge(token, mine, raw, frame, payload)
    sock.sendall(answer)
    return read_frame(sock, records)


def fingerprint(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
