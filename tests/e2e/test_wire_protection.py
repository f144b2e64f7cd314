"""Protected TCP traffic (docs/wire.md, "Protected traffic"), against a machine in the middle.

A relay on loopback (Proxy) sits between real initiators and a real target daemon. It reads
the stream as the wire lays it out (the handshake's fixed-size parts, then records) and can
flip a byte, drop, replay or reorder a record, and it keeps every byte it relays. Whatever
it does, the target never places a changed byte, the connection closes, and the initiator
sees its lane lost; what it captures holds no plaintext of what was written. With both ends
asked for ``none`` the same relay rewrites data unnoticed: that is what the default prevents.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import trio
from helpers import cli, pool_content, replica_file, wait_until, write_fsync

from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport import TransportError, barrier, connect, protection
from rpmemfs.transport.tokens import new_token_file, read_token_file
from rpmemfs.transport.wire import (
    HEADER_SIZE,
    HELLO_F_NO_AES,
    HELLO_F_PLAIN,
    HELLO_SIZE,
    RECORD_LEN_SIZE,
    RECORD_TAG_SIZE,
    Cipher,
    Op,
    Role,
    pack_header,
    unpack_header,
)

pytestmark = pytest.mark.timeout(120)

KiB = 1024
POOL = 1 << 20
I2T, T2I = "initiator->target", "target->initiator"
# What a record-aware relay hands its tamper function: (direction, unit, is a record) and
# gets back what to send instead (nothing: dropped; two: replayed ...).
Tamper = Callable[[str, bytes, bool], list[bytes]]


def _exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


class Proxy:
    """A man in the middle on loopback between initiators and one target."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.captured = {I2T: bytearray(), T2I: bytearray()}
        self.tamper: Tamper | None = None
        self.lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._socks += [client, server]
            for src, dst, way in ((client, server, I2T), (server, client, T2I)):
                threading.Thread(target=self._pump, args=(src, dst, way), daemon=True).start()

    def _send(self, dst: socket.socket, way: str, unit: bytes, record: bool) -> None:
        with self.lock:
            tamper = self.tamper
            self.captured[way] += unit
        for out in tamper(way, unit, record) if tamper is not None else [unit]:
            dst.sendall(out)

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            # The handshake's clear parts: HELLO and AUTH one way, CHALLENGE the other.
            if way == I2T:
                hello = _exact(src, HELLO_SIZE)
                self._send(dst, way, hello, False)
                plain = bool(hello[11] & HELLO_F_PLAIN)  # the flags byte
                head = _exact(src, HEADER_SIZE)
                auth = head + _exact(src, unpack_header(head).length)
                self._send(dst, way, auth, False)
            else:
                head = _exact(src, HEADER_SIZE)
                frame = unpack_header(head)
                self._send(dst, way, head + _exact(src, frame.length), False)
                plain = frame.op != Op.CHALLENGE or frame.imm == Cipher.NONE
            while True:
                if plain:
                    chunk = src.recv(1 << 16)
                    if not chunk:
                        break
                    self._send(dst, way, chunk, False)
                    continue
                length = _exact(src, RECORD_LEN_SIZE)
                (n,) = struct.unpack("<I", length)
                self._send(dst, way, length + _exact(src, n + RECORD_TAG_SIZE), True)
        except (EOFError, OSError):
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class Once:
    """A tamper function that acts on the first record (or clear chunk) in ``way`` whose
    size is at least ``min_size`` once armed, then lets everything through."""

    def __init__(self, way: str, action: str, min_size: int = 0) -> None:
        self.way, self.action, self.min_size = way, action, min_size
        self.armed = False
        self.done = False
        self.held: bytes | None = None

    def __call__(self, way: str, unit: bytes, record: bool) -> list[bytes]:
        if way != self.way or not self.armed or len(unit) < self.min_size:
            return [unit]
        if self.held is not None:  # reorder: the held record goes after this one
            held, self.held = self.held, None
            self.armed, self.done = False, True
            return [unit, held]
        if self.action == "reorder":
            self.held = unit
            return []
        self.armed, self.done = False, True
        if self.action == "flip":
            changed = bytearray(unit)
            changed[len(unit) // 2] ^= 0x01
            return [bytes(changed)]
        if self.action == "drop":
            return []
        assert self.action == "replay"
        return [unit, unit]


@pytest.fixture
def token(tmp_path: Path) -> bytes:
    path = tmp_path / "token"
    new_token_file(os.fspath(path))
    return read_token_file(os.fspath(path))


@pytest.fixture
def start_target(tmp_path: Path) -> Iterator[Callable[..., TargetProcess]]:
    procs: list[TargetProcess] = []

    def start(*extra: str) -> TargetProcess:
        d = tmp_path / f"pools{len(procs)}"
        d.mkdir(mode=0o700)
        t = TargetProcess(d, token_file=tmp_path / "token", pmem="msync",
                          extra=[*extra],
                          log_path=tmp_path / f"target{len(procs)}.log")
        t.start()
        procs.append(t)
        return t

    yield start
    for t in procs:
        t.close()


@pytest.fixture
def proxies() -> Iterator[Callable[[str], Proxy]]:
    made: list[Proxy] = []

    def make(target: str) -> Proxy:
        made.append(Proxy(target))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _pool_bytes(t: TargetProcess, name: str, n: int) -> bytes:
    with open(t.pool_dir / name, "rb") as f:
        return f.read(n)


def _log(t: TargetProcess) -> str:
    return t.log_text()


def _contains_any_window(haystack: bytes, data: bytes, size: int = 16) -> bool:
    return any(data[i : i + size] in haystack for i in range(0, len(data) - size, size))


# --------------------------------------------------------------------------- changed bytes


def test_a_flipped_byte_of_a_write_is_never_placed_and_closes_the_lane(
        start_target: Callable[..., TargetProcess], proxies: Callable[[str], Proxy], token: bytes) -> None:
    t = start_target()
    proxy = proxies(t.address)
    flip = Once(I2T, "flip", min_size=8 * KiB)
    proxy.tamper = flip
    data = os.urandom(64 * KiB)  # two full records and a bit: the flip lands in the second

    async def main() -> None:
        async with await connect(proxy.address, token, lanes=1, timeout=10) as s:
            region = await s.create_pool("flipped", POOL)
            flip.min_size = 30 * KiB
            await barrier(s.lanes[0], region, [(0, b"x" * 100)])  # small: untouched
            flip.armed = True
            with pytest.raises(TransportError) as err:
                await barrier(s.lanes[0], region, [(4096, data)])
            assert err.value.lane_lost, err.value
            assert s.lanes[0].closed
            # Another lane of the same session works; what it reads back is not the flip.
            lane = await s.open_lane()
            placed = await lane.read(region, 4096, len(data))
            assert all(p in (0, d) for p, d in zip(placed, data, strict=True))
            assert placed != data  # the record that failed its tag placed nothing

    trio.run(main)
    assert flip.done
    on_disk = _pool_bytes(t, "flipped", 4096 + len(data))[4096:]
    assert all(p in (0, d) for p, d in zip(on_disk, data, strict=True)), "a changed byte reached the pool"
    assert wait_until(lambda: "a record failed authentication" in _log(t)), _log(t)[-3000:]


def test_a_flipped_byte_of_a_verify_reply_is_refused(
        start_target: Callable[..., TargetProcess], proxies: Callable[[str], Proxy], token: bytes) -> None:
    t = start_target()
    proxy = proxies(t.address)
    flip = Once(T2I, "flip")
    proxy.tamper = flip

    async def main() -> None:
        async with await connect(proxy.address, token, lanes=1, timeout=10) as s:
            region = await s.create_pool("checked", POOL)
            await barrier(s.lanes[0], region, [(0, os.urandom(8192))])
            honest = await s.checksum(region, 0, POOL, 64 * KiB)
            flip.armed = True
            with pytest.raises(TransportError, match="failed authentication"):
                await s.checksum(region, 0, POOL, 64 * KiB)
            assert honest  # the forged answer was never returned in its place

    trio.run(main)
    assert flip.done


@pytest.mark.parametrize("action", ["drop", "replay", "reorder"])
def test_a_dropped_replayed_or_reordered_record_closes_the_lane(
        start_target: Callable[..., TargetProcess], proxies: Callable[[str], Proxy], token: bytes,
        action: str) -> None:
    t = start_target()
    proxy = proxies(t.address)
    tamper = Once(I2T, action)
    proxy.tamper = tamper

    async def main() -> None:
        async with await connect(proxy.address, token, lanes=1, timeout=10) as s:
            region = await s.create_pool("sequenced", POOL)
            lane = s.lanes[0]
            await barrier(lane, region, [(0, b"before")])
            tamper.armed = True
            # Two barriers, one record each, both sent before either is answered.
            first = lane.post(region, [(4096, b"A" * 100)])
            second = lane.post(region, [(8192, b"B" * 100)])
            with pytest.raises(TransportError) as err:
                await lane.wait(first)
                await lane.wait(second)
            assert err.value.lane_lost
            other = await s.open_lane()
            # The record after the one tampered with is never placed.
            assert await other.read(region, 8192, 100) == bytes(100)

    trio.run(main)
    assert tamper.done
    assert _pool_bytes(t, "sequenced", 8192 + 100)[8192:] == bytes(100)
    assert wait_until(lambda: "a record failed authentication" in _log(t)), _log(t)[-3000:]


def test_an_initiator_without_aes_instructions_gets_chacha20_poly1305(
        start_target: Callable[..., TargetProcess], token: bytes) -> None:
    """HELLO flag NO_AES (sent by an initiator whose CPU lacks AES-NI) makes the target seal
    with ChaCha20-Poly1305, on the control connection (Python) and on a lane (C loop)."""
    from test_target import RawConn  # the hand-made initiator of the raw-frame tests

    t = start_target()
    ctl, lane = RawConn(t.address), RawConn(t.address)
    try:
        sid = ctl.handshake(token, flags=HELLO_F_NO_AES)
        assert ctl.cipher == Cipher.CHACHA20_POLY1305
        reply = ctl.control({"op": "create", "name": "chacha", "size": POOL})
        assert reply["ok"], reply
        lane.handshake(token, Role.LANE, sid, flags=HELLO_F_NO_AES)
        assert lane.cipher == Cipher.CHACHA20_POLY1305
        data = os.urandom(40 * KiB)
        lane.send(pack_header(Op.WRITE, 0, reply["key"], 0, len(data), 1, 0) + data
                  + pack_header(Op.READ, 0, reply["key"], 0, len(data), 2, 0))
        frame, payload = lane.frame()
        assert frame.op == Op.READ_RESP and payload == data
    finally:
        ctl.close()
        lane.close()
    assert _pool_bytes(t, "chacha", len(data)) == data
    # Without the flag, on this CPU (AES-NI here, as cpuid says): AES-256-GCM.
    other = RawConn(t.address)
    try:
        other.handshake(token)
        assert other.cipher == (Cipher.AES_256_GCM if protection.has_aes() else Cipher.CHACHA20_POLY1305)
    finally:
        other.close()


# --------------------------------------------------------------------------- what is seen


def test_the_wire_carries_no_plaintext_of_what_was_written(
        start_target: Callable[..., TargetProcess], proxies: Callable[[str], Proxy], token: bytes) -> None:
    t = start_target()
    proxy = proxies(t.address)
    data = os.urandom(200 * KiB)
    name = "a-rather-distinctive-pool-name"

    async def main() -> None:
        async with await connect(proxy.address, token, lanes=2, timeout=10) as s:
            region = await s.create_pool(name, POOL)
            await barrier(s.lanes[0], region, [(0, data)])
            assert await s.lanes[1].read(region, 0, len(data)) == data

    trio.run(main)
    for way in (I2T, T2I):
        seen = bytes(proxy.captured[way])
        assert len(seen) > len(data)
        assert not _contains_any_window(seen, data), f"plaintext of the write seen {way}"
        assert name.encode() not in seen
    assert _pool_bytes(t, name, len(data)) == data


# --------------------------------------------------------------------------- the opt-out


def test_both_ends_plain_work_and_are_exposed(
        start_target: Callable[..., TargetProcess], proxies: Callable[[str], Proxy], token: bytes) -> None:
    """The opt-out works when both ends ask for it, and it is what it says: the same relay
    reads the data and rewrites it unnoticed."""
    t = start_target("--wire-protection", "none")
    proxy = proxies(t.address)
    flip = Once(I2T, "flip", min_size=30 * KiB)
    proxy.tamper = flip
    data = os.urandom(64 * KiB)

    async def main() -> None:
        async with await connect(proxy.address, token, lanes=1, timeout=10, wire_protection="none") as s:
            region = await s.create_pool("plain", POOL)
            assert s.info["wire_protection"] == "none"
            await barrier(s.lanes[0], region, [(0, b"clear")])
            flip.armed = True
            await barrier(s.lanes[0], region, [(4096, data)])  # "succeeds"

    trio.run(main)
    assert flip.done
    assert _contains_any_window(bytes(proxy.captured[I2T]), data)
    on_disk = _pool_bytes(t, "plain", 4096 + len(data))[4096:]
    assert on_disk != data and sum(a != b for a, b in zip(on_disk, data, strict=True)) == 1


def test_mismatched_ends_are_refused_with_the_reason(
        start_target: Callable[..., TargetProcess], token: bytes) -> None:
    protected, plain = start_target(), start_target("--wire-protection", "none")
    with pytest.raises(TransportError, match="runs with --wire-protection none") as err:
        trio.run(connect, plain.address, token)
    assert "requires protection" in str(err.value)
    with pytest.raises(TransportError, match="protects its traffic and the initiator asked for none"):
        trio.run(partial(connect, protected.address, token, wire_protection="none"))
    with pytest.raises(TransportError, match="must be aead or none"):
        trio.run(partial(connect, protected.address, token, wire_protection="sometimes"))
    assert "protection" in _log(plain) and "protection" in _log(protected)


def test_the_cli_and_mount_options_choose_the_protection(
        start_target: Callable[..., TargetProcess], tmp_path: Path, token: bytes) -> None:
    plain = start_target("--wire-protection", "none")
    token_file = tmp_path / "token"
    res = cli("pools", plain.address, "--token-file", token_file)
    assert res.returncode == 3 and "--wire-protection none" in res.stderr, res.stderr  # refused
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = cli("--wire-protection", "none", "pools", plain.address, "--token-file", token_file)
    assert res.returncode == 0, res.stderr
    res = cli("pools", plain.address, "--token-file", token_file, "--wire-protection", "none")
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------- a mount


def test_a_mount_whose_replica_traffic_is_changed_fails_fsync_and_resyncs(
        start_target: Callable[..., TargetProcess], proxies: Callable[[str], Proxy],
        tmp_path: Path, mount_pool: Callable[..., object], token: bytes) -> None:
    t = start_target()
    proxy = proxies(t.address)
    flip = Once(I2T, "flip", min_size=16 * KiB)
    proxy.tamper = flip
    pool = tmp_path / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", "--token-file", tmp_path / "token",
              "--replica", f"{proxy.address}/app")
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options="pmem=force,replica_timeout=5")
    mnt = m.path  # type: ignore[attr-defined]
    write_fsync(mnt / "before", b"b" * 10000)
    flip.armed = True
    with pytest.raises(OSError) as err:
        write_fsync(mnt / "changed", os.urandom(256 * KiB))
    assert err.value.errno == errno.EIO  # policy all, and the one replica was left out
    assert flip.done
    # The flip was one-shot: the replica comes back through the same relay and catches up.
    assert wait_until(lambda: "a record failed authentication" in _log(t), timeout=10)
    time.sleep(0.1)
    deadline = time.monotonic() + 60
    while True:
        try:
            write_fsync(mnt / "after", b"a" * 10000)
            break
        except OSError as exc:
            assert exc.errno == errno.EIO and time.monotonic() < deadline
            time.sleep(0.2)
    m.unmount()  # type: ignore[attr-defined]
    assert pool_content(replica_file(t)) == pool_content(pool)
