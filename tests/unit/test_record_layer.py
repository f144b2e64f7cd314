"""The record layer of protected connections (native/rpmem_sec.c through SockIO), against a
second implementation: records sealed here open with ``cryptography``'s AEADs by the layout
docs/wire.md gives, and the other way round; any change, replay, drop or reorder is refused
and the refusal sticks. Over a socketpair, no other process."""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from rpmemfs.transport.sockio import SockIO
from rpmemfs.transport.wire import RECORD_LEN_SIZE, RECORD_MAX, RECORD_TAG_SIZE, Cipher

TX, RX = os.urandom(32), os.urandom(32)
AEADS = {Cipher.AES_256_GCM: AESGCM, Cipher.CHACHA20_POLY1305: ChaCha20Poly1305}


def _nonce(seq: int) -> bytes:
    return struct.pack("<Q", seq) + bytes(4)


def _seal(cipher: Cipher, key: bytes, seq: int, data: bytes) -> bytes:
    head = struct.pack("<I", len(data))
    return head + AEADS[cipher](key).encrypt(_nonce(seq), data, head)


def _records(raw: bytes) -> Iterator[tuple[bytes, bytes]]:
    while raw:
        (n,) = struct.unpack_from("<I", raw)
        whole = RECORD_LEN_SIZE + n + RECORD_TAG_SIZE
        yield raw[:RECORD_LEN_SIZE], raw[RECORD_LEN_SIZE:whole]
        raw = raw[whole:]


@pytest.fixture(params=list(AEADS), ids=lambda c: c.name)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Cipher, SockIO, socket.socket]]:
    """(cipher, our protected end, the raw other end)."""
    a, b = socket.socketpair()
    io = SockIO(a)
    io.protect(request.param, TX, RX)
    b.settimeout(5)
    yield request.param, io, b
    a.close()
    b.close()


def _recv_all(io: SockIO, n: int) -> bytes:
    buf = bytearray(n)
    got = 0
    while got < n:
        got += io.recv_nowait(memoryview(buf)[got:])
    return bytes(buf)


def test_what_we_seal_opens_by_the_documented_layout(pair: tuple[Cipher, SockIO, socket.socket]) -> None:
    cipher, io, peer = pair
    parts = [os.urandom(100), os.urandom(RECORD_MAX + 5000), b"", os.urandom(7)]
    total = sum(map(len, parts))
    assert io.sendv_nowait(parts) == total and io.pending == 0
    raw = b""
    while len(raw) < total + 2 * (RECORD_LEN_SIZE + RECORD_TAG_SIZE):
        raw += peer.recv(1 << 20)
    opened = [AEADS[cipher](TX).decrypt(_nonce(seq), body, head)
              for seq, (head, body) in enumerate(_records(raw))]
    assert [len(p) for p in opened] == [RECORD_MAX, total - RECORD_MAX]  # cut from the stream
    assert b"".join(opened) == b"".join(parts)
    assert raw.find(parts[1][:64]) < 0  # no plaintext on the wire


def test_records_sealed_elsewhere_open_in_order(pair: tuple[Cipher, SockIO, socket.socket]) -> None:
    cipher, io, peer = pair
    msgs = [os.urandom(n) for n in (1, 4096, RECORD_MAX)]
    peer.sendall(b"".join(_seal(cipher, RX, seq, m) for seq, m in enumerate(msgs)))
    assert _recv_all(io, sum(map(len, msgs))) == b"".join(msgs)
    with pytest.raises(BlockingIOError):
        io.recv_nowait(memoryview(bytearray(10)))


@pytest.mark.parametrize("harm", ["flip", "replay", "drop", "reorder", "wrong key", "too long"])
def test_a_harmed_record_is_refused_and_the_refusal_sticks(
        pair: tuple[Cipher, SockIO, socket.socket], harm: str) -> None:
    cipher, io, peer = pair
    good = [_seal(cipher, RX, seq, f"record {seq}".encode() * 10) for seq in range(3)]
    stream = {
        "flip": [good[0], good[1][:20] + bytes([good[1][20] ^ 1]) + good[1][21:]],
        "replay": [good[0], good[0]],
        "drop": [good[0], good[2]],
        "reorder": [good[0], good[2], good[1]],
        "wrong key": [good[0], _seal(cipher, TX, 1, b"record 1" * 10)],
        "too long": [good[0], struct.pack("<I", RECORD_MAX + 1) + bytes(64)],
    }[harm]
    peer.sendall(b"".join(stream))
    assert _recv_all(io, 80) == b"record 0" * 10  # the first record is intact
    code = errno.EPROTO if harm == "too long" else errno.EBADMSG
    for _ in range(2):
        with pytest.raises(OSError) as err:
            io.recv_nowait(memoryview(bytearray(100)))
        assert err.value.errno == code
    # ... and the connection sends nothing more either.
    with pytest.raises(OSError) as err:
        io.sendv_nowait([b"after"])
    assert err.value.errno == code


Pair = tuple[Cipher, SockIO, socket.socket]


def test_the_end_of_the_stream_inside_a_record_is_an_error(pair: Pair) -> None:
    cipher, io, peer = pair
    peer.sendall(_seal(cipher, RX, 0, b"whole") + _seal(cipher, RX, 1, b"cut short")[:10])
    peer.shutdown(socket.SHUT_WR)
    assert _recv_all(io, 5) == b"whole"
    with pytest.raises(OSError) as err:
        while True:
            io.recv_nowait(memoryview(bytearray(10)))
    assert err.value.errno == errno.EPIPE
