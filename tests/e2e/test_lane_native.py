"""The target's lane receive loop in a C thread (native/rpmem_lane.c), against real daemons.

Every target here is a real `python -m rpmemfs.target` process on loopback with its pools on
/dev/shm. The C loop is the one data path: it checks every frame, serves WRITE, READ,
ATOMIC_WRITE and flush SENDs (flush lists larger than its staging buffer a piece at a time), and
hands only control SENDs to the Python loop; what it refuses, Python puts in words. The pool
file, the replies and the target's counters are compared with a model. Raw connections use
tests/e2e/test_target.py's RawConn to send what no well-behaved initiator would, or to send it a
few bytes at a time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import cpu_seconds, cpu_wanted, pin_process
from test_target import RawConn, Running, pool_name

from rpmemfs.chunksum import chunk_sums
from rpmemfs.transport import (
    PackedRanges,
    RemoteRegion,
    TcpLane,
    TcpSession,
    TransportError,
    barrier,
    connect,
)
from rpmemfs.transport.wire import (
    F_CLOSE,
    F_FLUSH,
    HEADER,
    MAX_READ,
    Code,
    Frame,
    Op,
    Role,
    SendKind,
    encode_flush,
)

pytestmark = pytest.mark.timeout(60)

KiB, MiB = 1 << 10, 1 << 20
POOL = 1 * MiB
BIG_POOL = 16 * MiB
# More ranges than the 64 KiB staging buffer holds: the C loop takes such a list in pieces.
LARGE_FLUSH_RANGES = 5000
TRUNCATED = "closing lane: truncated frame (closed mid-frame)"


def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return trio.run(fn, *args)


def hdr(op: int, key: int = 0, offset: int = 0, length: int = 0, *, id_: int = 1, imm: int = 0,
        flags: int = 0, reserved: int = 0) -> bytes:
    return HEADER.pack(op, flags, reserved, key, offset, length, id_, imm)


def flush_frame(key: int, ranges: list[tuple[int, int]], id_: int = 1) -> bytes:
    body = encode_flush(ranges)
    return hdr(Op.SEND, key, 0, len(body), id_=id_, imm=SendKind.FLUSH) + body


def pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def assert_same(got: bytes, want: bytes | bytearray, what: str) -> None:
    """Byte equality with a short message (pytest's diff of megabytes is useless and slow)."""
    if got == want:
        return
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} bytes, expected {len(want)}")
    first = next(i for i in range(len(got)) if got[i] != want[i])
    raise AssertionError(
        f"{what}: first difference at offset {first}: got {got[first:first + 16].hex()}, "
        f"expected {bytes(want[first:first + 16]).hex()}"
    )


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def expect_frame(raw: RawConn, op: Op, id_: int) -> bytes:
    frame, payload = raw.frame()
    assert (frame.op, frame.id) == (op, id_), (Op(frame.op).name, frame, payload[:200])
    return payload


def expect_error_close(raw: RawConn) -> tuple[Frame, str]:
    """The next frame is an ERROR with F_CLOSE, and the target then closes the connection."""
    frame, payload = raw.frame()
    assert frame.op == Op.ERROR and frame.flags & F_CLOSE, (frame, payload[:200])
    assert raw.eof(), "the target kept the connection open after a violation"
    return frame, payload.decode()


def raw_session(address: str, size: int = POOL) -> tuple[RawConn, int, bytes, str]:
    """A raw control connection with a fresh pool of ``size``: (conn, key, session id, name)."""
    ctl = RawConn(address)
    sid = ctl.handshake()
    name = pool_name()
    reply = ctl.control({"op": "create", "name": name, "size": size})
    assert reply["ok"], reply
    return ctl, int(reply["key"]), sid, name


def raw_lane(address: str, sid: bytes) -> RawConn:
    lane = RawConn(address)
    lane.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lane.sock.settimeout(10)
    lane.handshake(role=Role.LANE, sid=sid)
    return lane


def raw_roundtrip(lane: RawConn, key: int, offset: int, data: bytes, id_: int) -> None:
    """WRITE then READ of the same bytes on a raw lane: the READ must see the WRITE."""
    lane.send(hdr(Op.WRITE, key, offset, len(data), id_=id_) + data
              + hdr(Op.READ, key, offset, len(data), id_=id_ + 1))
    assert expect_frame(lane, Op.READ_RESP, id_ + 1) == data


def region_of(reply: dict[str, Any]) -> RemoteRegion:
    return RemoteRegion(name=reply["name"], key=int(reply["key"]), size=int(reply["size"]), uuid=None,
                        method=reply["method"], pmem=reply["pmem"])


# --------------------------------------------------------------------------- targets


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-lane-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def targets(scratch: Path) -> Iterator[Callable[..., Running]]:
    """targets(method="gpspm", *extra): one shared daemon per configuration, each
    checked at the end of the module to stop with exit 0 and no traceback in its log."""
    started: dict[tuple[str, ...], Running] = {}

    def get(method: str = "gpspm", *extra: str) -> Running:
        key = (method, *extra)
        if key not in started:
            kw: dict[str, Any] = {"persist": "apm", "pmem": "force"} if method == "apm" else {}
            started[key] = Running(scratch, extra=[*extra], **kw)
        return started[key]

    yield get
    for t in started.values():
        log = t.finish()
        assert "internal error" not in log, log


async def session(t: Running, lanes: int = 1) -> TcpSession:
    return await connect(t.address, None, lanes=lanes, timeout=20)


# --------------------------------------------------------------------------- 1. mixed traffic


@pytest.mark.parametrize("method", ["gpspm", "apm"])
def test_mixed_traffic_lands_byte_exact_and_is_counted_exactly(
    targets: Callable[..., Running], method: str
) -> None:
    t = targets(method)
    name = pool_name()
    rng = random.Random(method)
    model = bytearray(BIG_POOL)
    sent = {"writes": 0, "bytes": 0, "flushes": 0, "reads": 0, "atomics": 0}

    def rnd(n: int) -> bytes:
        return rng.randbytes(n)

    def place(writes: list[tuple[int, bytes]]) -> None:
        for off, data in writes:
            model[off : off + len(data)] = data
            sent["writes"] += 1
            sent["bytes"] += len(data)

    # Batches of writes, each made durable by one barrier: tiny, 4 KiB, a payload larger than
    # the staging buffer (straight into the mapping), several MiB, many small ones in one send,
    # and overlapping writes whose order on the lane decides the outcome.
    batches: list[list[tuple[int, bytes]]] = [
        [(0, b"x")],
        [(3, rnd(13)), (4096, rnd(4096))],
        [(70_001, rnd(100_000))],
        [(8 * MiB + 5, rnd(5 * MiB + 7))],
        [(2 * MiB + i * 4099, rnd(1 + i * 31 % 700)) for i in range(300)],
        [(4096, rnd(64 * KiB + 1)), (4100, b"overlap, later wins")],
        [(BIG_POOL - 17, rnd(17))],
    ]

    async def check_read(lane: TcpLane, region: RemoteRegion, off: int, length: int) -> None:
        got = await lane.read(region, off, length)
        sent["reads"] += 1
        assert_same(got, model[off : off + length], f"read ({off}, {length})")

    async def main() -> None:
        async with await session(t, lanes=2) as s:
            region = await s.create_pool(name, BIG_POOL)
            assert region.method == method
            lane, other = s.lanes
            for i, writes in enumerate(batches):
                # Both flush ops on both kinds of target, the region's own first.
                flush = [method, "apm" if method == "gpspm" else "gpspm"][i % 2]
                if i % 3 == 0:
                    await barrier(lane, region, writes, flush)
                else:
                    ticket = lane.post(region, writes, flush)
                    with trio.fail_after(20):
                        if i % 3 == 1 or ticket.rest:  # else only poll for the completion
                            await lane.wait(ticket)
                        while not lane.poll(ticket):
                            await trio.sleep(0.001)
                place(writes)
                sent["flushes"] += 1
                off, data = writes[-1]
                start = max(0, off - 100)
                await check_read(lane, region, start, min(len(data) + 200, BIG_POOL - start))
            # Atomic stores: over earlier data, at the very end, with every bit pattern.
            for off, value in [(0, 0), (4096, (1 << 64) - 1), (70_008, 0x0102030405060708),
                               (BIG_POOL - 8, rng.getrandbits(64)), (8 * MiB + 8, rng.getrandbits(64))]:
                await lane.atomic_write(region, off, value)
                model[off : off + 8] = value.to_bytes(8, "little")
                sent["atomics"] += 1
            await check_read(lane, region, 0, 80 * KiB)  # ordered after the atomics
            # The other lane: its own barrier, then it reads what the first lane placed.
            tail = [(12 * MiB, rnd(3 * MiB))]
            await barrier(other, region, tail, method)
            place(tail)
            sent["flushes"] += 1
            await check_read(other, region, 0, MAX_READ)  # the whole pool in one READ
            await check_read(other, region, BIG_POOL - 8, 8)

            stats = (await s.stats(name))[name]
            assert {k: stats[k] for k in sent} == sent, (stats, sent)
            assert stats["open"] is True

    run(main)
    assert_same(pread(t.pool_dir / name, 0, BIG_POOL), model, f"pool file ({method})")


@pytest.mark.parametrize("method", ["gpspm", "apm"])
def test_packed_copies_land_where_their_ranges_say(targets: Callable[..., Running], method: str) -> None:
    """post of PackedRanges (asynchronous replication's copies, sent from C): each range's bytes
    from its place in the packed buffer to its own offset; a buffer that does not match the
    ranges, or a range outside the pool, sends nothing."""
    t = targets(method)
    name = pool_name()
    rng = random.Random(method)

    async def main() -> None:
        async with await session(t) as s:
            lane = s.lanes[0]
            region = await s.create_pool(name, POOL)
            model = bytearray(POOL)
            for _ in range(20):
                ranges = sorted({(rng.randrange(0, POOL - 8192) & ~63, rng.randrange(1, 8192))
                                 for _ in range(rng.randrange(1, 6))})
                chunks = [rng.randbytes(k) for _, k in ranges]
                for (off, k), chunk in zip(ranges, chunks, strict=True):
                    model[off : off + k] = chunk
                await lane.wait(lane.post(region, PackedRanges(b"".join(chunks), ranges), method))
            assert await lane.read(region, 0, POOL) == bytes(model)
            with pytest.raises(ValueError):
                lane.post(region, PackedRanges(b"x" * 10, [(0, 4), (64, 4)]))
            with pytest.raises(TransportError):
                lane.post(region, PackedRanges(b"y" * 8, [(0, 4), (POOL - 2, 4)]))
            assert await lane.read(region, 0, POOL) == bytes(model)  # neither sent anything

    run(main)


# --------------------------------------------------------------------------- 2. handoff


def test_control_requests_on_a_lane_are_answered_in_order_between_data_frames(
    targets: Callable[..., Running],
) -> None:
    t = targets()
    name, name2 = pool_name(), pool_name()
    model = bytearray(POOL)

    async def main() -> None:
        async with await session(t, lanes=2) as s:
            region = await s.create_pool(name, POOL)
            lane = s.lanes[0]
            writes = 0
            for i in range(12):
                data = os.urandom(100 + 97 * i)
                off = 1000 * i + 3
                await lane.post_writes(region, [(off, data)])
                model[off : off + len(data)] = data
                writes += 1
                # Served after the write on the same lane: the counter already includes it.
                reply = await lane.request({"op": "stats", "name": name})
                assert reply["pools"][name]["writes"] == writes, reply
                # A control SEND with a barrier right behind it in the same stream: both answered.
                await lane.send(json.dumps({"op": "info"}).encode())
                more = os.urandom(50)
                ticket = lane.post(region, [(500_000 + 64 * i, more)])
                info = json.loads(await lane.recv())
                assert info["ok"] and info["wire_version"] == 2 and info["method"] == "gpspm", info
                await lane.wait(ticket)
                model[500_000 + 64 * i : 500_000 + 64 * i + 50] = more
                writes += 1
                # A checksum on the lane sees every earlier write on it.
                crcs = (await lane.request(
                    {"op": "checksum", "key": region.key, "offset": 0, "length": 16 * KiB, "chunk": 4096}
                ))["crcs"]
                assert crcs == chunk_sums(memoryview(model), 0, 16 * KiB, 4096)
                assert await lane.read(region, off, len(data)) == data

            # A refused request is a clean reply; the lane goes on.
            with pytest.raises(TransportError, match="does not exist") as err:
                await lane.request({"op": "open", "name": pool_name()})
            assert not err.value.lane_lost and not lane.closed

            # A pool registered through the lane is usable on it at once, and once closed
            # through the lane its key is refused on the session's other lane.
            second = region_of(await lane.request({"op": "create", "name": name2, "size": POOL}))
            await barrier(lane, second, [(4096, b"second pool")])
            assert await lane.read(second, 4096, 11) == b"second pool"
            assert (await lane.request({"op": "close", "key": second.key}))["ok"]
            with pytest.raises(TransportError, match="unregistered key") as err:
                await barrier(s.lanes[1], second, [(0, b"stale key")])
            assert err.value.lane_lost

            # A flush list larger than the C loop's staging buffer is taken in pieces.
            ranges = [(i * 128, 16) for i in range(LARGE_FLUSH_RANGES)]
            await lane.flush_send(region, ranges)
            await barrier(lane, region, [(0, b"after the big flush")])
            model[0:19] = b"after the big flush"
            writes += 1
            stats = (await s.stats(name))[name]
            assert stats["writes"] == writes and stats["flushes"] == 12 + 2
            assert stats["persisted_ranges"] >= LARGE_FLUSH_RANGES
            assert not lane.closed

    run(main)
    assert_same(pread(t.pool_dir / name, 0, POOL), model, "pool file")
    assert pread(t.pool_dir / name2, 4096, 11) == b"second pool"


# --------------------------------------------------------------------------- 3. violations


def _violations() -> list[Any]:
    """(name, bad frame given (key, stale key), code, whether the header parses, logged reason)."""
    big = encode_flush([(i * 64, 8) for i in range(LARGE_FLUSH_RANGES)] + [(POOL - 4, 8)])
    cases: list[tuple[str, Callable[[int, int], bytes], int, bool, str]] = [
        ("unregistered key", lambda k, s: hdr(Op.WRITE, k ^ 0x5A5A5A5A, 0, 4, id_=7777) + b"evil",
         Code.BAD_KEY, True, "WRITE with unregistered key"),
        ("key closed meanwhile", lambda k, s: hdr(Op.WRITE, s, 0, 4, id_=7777) + b"evil",
         Code.BAD_KEY, True, "WRITE with unregistered key"),
        ("out-of-bounds write", lambda k, s: hdr(Op.WRITE, k, POOL - 2, 4, id_=7777) + b"evil",
         Code.OUT_OF_BOUNDS, True, "is outside pool"),
        ("oversized write", lambda k, s: hdr(Op.WRITE, k, 0, 0xFFFFFFFF, id_=7777),
         Code.TOO_LARGE, True, "exceeds the limit"),
        ("unknown op", lambda k, s: hdr(0x7E, k, id_=7777), Code.BAD_FRAME, False, "unknown op 0x7e"),
        ("reserved field", lambda k, s: hdr(Op.WRITE, k, 0, 4, id_=7777, reserved=1) + b"evil",
         Code.BAD_FRAME, False, "reserved header field"),
        ("unknown flag", lambda k, s: hdr(Op.WRITE, k, 0, 4, id_=7777, flags=0x80) + b"evil",
         Code.BAD_FRAME, False, "unknown flags 0x80"),
        ("flush range out of bounds", lambda k, s: flush_frame(k, [(0, 8), (POOL - 1, 2)], 7777),
         Code.OUT_OF_BOUNDS, True, "flush range"),
        ("large flush list out of bounds",
         lambda k, s: hdr(Op.SEND, k, 0, len(big), id_=7777, imm=SendKind.FLUSH) + big,
         Code.OUT_OF_BOUNDS, True, "flush range"),
        ("flush count lies",
         lambda k, s: hdr(Op.SEND, k, 0, 20, id_=7777, imm=SendKind.FLUSH) + struct.pack("<IQQ", 5, 0, 1),
         Code.BAD_FRAME, True, "does not hold the 5 ranges"),
        ("flush without its count",
         lambda k, s: hdr(Op.SEND, k, 0, 2, id_=7777, imm=SendKind.FLUSH) + b"\0\0",
         Code.BAD_FRAME, True, "shorter than its count"),
        ("oversized flush", lambda k, s: hdr(Op.SEND, k, 0, (4 << 20) + 4, id_=7777, imm=SendKind.FLUSH),
         Code.TOO_LARGE, True, "exceeds the limit of 4194304"),
        ("oversized control request on a lane",
         lambda k, s: hdr(Op.SEND, 0, 0, (64 << 10) + 1, id_=7777, imm=SendKind.CONTROL),
         Code.TOO_LARGE, True, "exceeds the limit of 65536"),
        ("atomic with a payload", lambda k, s: hdr(Op.ATOMIC_WRITE, k, 8, 8, id_=7777, imm=1) + b"12345678",
         Code.BAD_FRAME, True, "has no payload"),
        ("misaligned atomic", lambda k, s: hdr(Op.ATOMIC_WRITE, k, 12, id_=7777, imm=1),
         Code.MISALIGNED, True, "not 8-byte aligned"),
        ("oversized read", lambda k, s: hdr(Op.READ, k, 0, MAX_READ + 1, id_=7777),
         Code.TOO_LARGE, True, "exceeds the limit"),
        ("reply op from initiator", lambda k, s: hdr(Op.READ_RESP, k, id_=7777),
         Code.NOT_ALLOWED, True, "not something an initiator sends"),
    ]
    return [pytest.param(*c, id=c[0]) for c in cases]


def _good_frames(key: int, first: int, count: int, base_id: int) -> tuple[bytes, bytes]:
    """``count`` small WRITEs and a large one, then a READ, a flush SEND and a flush READ:
    (the frames, the bytes the READ must return). Ids base_id+1..3 are the answered ones."""
    small = b"".join(bytes([(first + i) % 251]) * 40 for i in range(count))
    frames = [hdr(Op.WRITE, key, (first + i) * 64, 40, id_=base_id) + small[i * 40 : (i + 1) * 40]
              for i in range(count)]
    big = bytes([first % 256]) * (200 * KiB)
    frames.append(hdr(Op.WRITE, key, 256 * KiB + first * 1024, len(big), id_=base_id) + big)
    frames.append(hdr(Op.ATOMIC_WRITE, key, 512 * KiB + 8 * first, id_=base_id, imm=first))
    expect = b"".join(bytes([(first + i) % 251]) * 40 + b"\0" * 24 for i in range(count))[:-24]
    frames.append(hdr(Op.READ, key, first * 64, len(expect), id_=base_id + 1))
    frames.append(flush_frame(key, [(first * 64, count * 64), (256 * KiB, 400 * KiB)], base_id + 2))
    frames.append(hdr(Op.READ, key, 0, 8, id_=base_id + 3, flags=F_FLUSH))
    return b"".join(frames), expect


def _answers(lane: RawConn, base_id: int, expect: bytes) -> None:
    assert expect_frame(lane, Op.READ_RESP, base_id + 1) == expect
    assert expect_frame(lane, Op.SEND_REPLY, base_id + 2) == b""
    assert len(expect_frame(lane, Op.READ_RESP, base_id + 3)) == 8


@pytest.mark.parametrize(("case", "bad", "code", "parses", "reason"), _violations())
def test_a_violation_after_many_good_frames_closes_only_that_lane(
    targets: Callable[..., Running], case: str, bad: Callable[[int, int], bytes], code: int,
    parses: bool, reason: str,
) -> None:
    t = targets()
    ctl, key, sid, name = raw_session(t.address)
    stale = int(ctl.control({"op": "open", "name": name})["key"])
    assert ctl.control({"op": "close", "key": stale})["ok"]
    by_ctl, by_key, by_sid, _ = raw_session(t.address)  # another session, a bystander
    lanes = [raw_lane(t.address, sid), raw_lane(t.address, sid), raw_lane(t.address, by_sid)]
    victim, sibling, bystander = lanes
    try:
        raw_roundtrip(sibling, key, POOL - 8192, b"sibling before", 10)
        raw_roundtrip(bystander, by_key, 0, b"bystander before", 10)
        # Many good frames, answered; then more, with the violation right behind them in the
        # same send, so the C loop leaves it in the middle of its staging buffer.
        frames, expect = _good_frames(key, 1, 150, 100)
        victim.send(frames)
        _answers(victim, 100, expect)
        frames, expect2 = _good_frames(key, 2, 150, 200)
        victim.send(frames + bad(key, stale))
        _answers(victim, 200, expect2)
        frame, text = expect_error_close(victim)
        logged = f"closing lane: {text}"
        assert frame.imm == code, (case, Code(frame.imm).name, text)
        assert reason in text, (case, text)
        if parses:
            assert frame.id == 7777, f"{case}: ERROR names request {frame.id}, not the offending 7777"
        # The good frames before the violation were all placed; nothing of the bad one was.
        raw_roundtrip(sibling, key, POOL - 4096, b"sibling after", 20)
        sibling.send(hdr(Op.READ, key, 2 * 64, len(expect2), id_=30)
                     + hdr(Op.READ, key, 256 * KiB + 2048, 200 * KiB, id_=31)
                     + hdr(Op.READ, key, 512 * KiB + 16, 8, id_=32)
                     + hdr(Op.READ, key, 0, 64, id_=33))
        assert expect_frame(sibling, Op.READ_RESP, 30) == expect2
        assert expect_frame(sibling, Op.READ_RESP, 31) == b"\x02" * (200 * KiB)
        assert expect_frame(sibling, Op.READ_RESP, 32) == (2).to_bytes(8, "little")
        assert expect_frame(sibling, Op.READ_RESP, 33) == b"\0" * 64
        raw_roundtrip(bystander, by_key, 0, b"bystander after", 20)
        assert ctl.control({"op": "info"})["ok"] and by_ctl.control({"op": "info"})["ok"]
        stats = ctl.control({"op": "stats", "name": name})["pools"][name]
        # 2 x (150 + 1) writes and the sibling's 2; 2 x 2 flushes; 2 + 2 + 4 reads; 2 atomics.
        assert (stats["writes"], stats["flushes"], stats["reads"], stats["atomics"]) == (304, 4, 8, 2), stats
    finally:
        for c in (*lanes, ctl, by_ctl):
            c.close()
    assert wait_for(lambda: logged in t.proc.log_text()), f"no {logged!r} in the target's log"


# --------------------------------------------------------------------------- 4. close mid-frame


def _pool_open(ctl: RawConn, name: str) -> bool:
    return bool(ctl.control({"op": "stats", "name": name})["pools"][name]["open"])


@pytest.mark.parametrize("finish", ["complete", "truncate", "end-session"])
def test_closing_a_pool_while_a_lane_is_inside_a_large_write(
    targets: Callable[..., Running], finish: str
) -> None:
    t = targets()
    size, total, first = 16 * MiB, 8 * MiB, 1 * MiB
    payload = random.Random(finish).randbytes(total)
    ctl, key, sid, name = raw_session(t.address, size)
    watcher = RawConn(t.address)  # another session, to watch the pool's state
    watcher_sid = watcher.handshake()
    lane = raw_lane(t.address, sid)
    try:
        raw_roundtrip(lane, key, 0, b"warm", 1)
        lane.send(hdr(Op.WRITE, key, 4096, total, id_=3) + payload[:first])
        # Once its first bytes show in the pool file, the lane's C thread is inside the frame
        # (it holds the region) and stays there until the payload ends.
        assert wait_for(lambda: pread(t.pool_dir / name, 4096, 64) == payload[:64])
        if finish == "end-session":
            ctl.close()  # the session ends: its lanes are closed, its pools released
            lane.sock.settimeout(10)
            assert lane.eof(), "the lane outlived its session"
        else:
            assert ctl.control({"op": "close", "key": key}) == {"ok": True}
            assert _pool_open(watcher, name), "unmapped while a lane was writing into it"
            if finish == "complete":
                lane.send(payload[first:] + hdr(Op.READ, key, 4096, 8, id_=4))
                frame, text = expect_error_close(lane)
                # The rest of the payload was consumed as payload: the next frame was parsed
                # from the right place, and refused for its key.
                assert (frame.imm, frame.id) == (Code.BAD_KEY, 4), (frame, text)
            else:
                lane.close()
        assert wait_for(lambda: not _pool_open(watcher, name)), "the pool was never closed"
        # The target still serves, and the pool opens again, its bytes intact.
        reply = watcher.control({"op": "open", "name": name})
        assert reply["ok"], reply
        again = raw_lane(t.address, watcher_sid)
        try:
            lane2_key = int(reply["key"])
            raw_roundtrip(again, lane2_key, 0, b"reopened", 10)
            again.send(hdr(Op.READ, lane2_key, 4096, total, id_=20))
            got = expect_frame(again, Op.READ_RESP, 20)
            if finish == "complete":
                assert_same(got, payload, "the write finished after the close")
            else:
                assert not any(got[first:total]), "bytes that were never sent are in the pool"
        finally:
            again.close()
    finally:
        for c in (lane, ctl, watcher):
            c.close()


def test_closing_a_pool_under_a_stream_of_large_writes(targets: Callable[..., Running]) -> None:
    t = targets()
    name = pool_name()
    chunk = os.urandom(4 * MiB)

    async def main() -> None:
        async with await session(t, lanes=2) as s:
            region = await s.create_pool(name, BIG_POOL)
            streamer, other = s.lanes
            posted = 0
            failed: list[TransportError] = []

            async def stream() -> None:
                nonlocal posted
                try:
                    for i in range(2000):
                        await streamer.post_writes(region, [((i % 3) * 4 * MiB, chunk)])
                        posted += 1
                        if i % 8 == 7:
                            await streamer.read(region, 0, 8)
                except TransportError as exc:
                    failed.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                while posted < 20:
                    await trio.sleep(0.005)
                await s.close_pool(region)
            assert failed, "the lane kept writing into a closed pool"
            assert failed[0].lane_lost and streamer.closed
            # The session's other lane, the pool reopened, and a new lane all work.
            again = await s.open_pool(name)
            await barrier(other, again, [(12 * MiB, b"after the close")])
            fresh = await s.open_lane()
            assert await fresh.read(again, 12 * MiB, 15) == b"after the close"
            assert await fresh.read(again, 0, len(chunk)) == chunk

        async with await session(t) as s2:
            region = await s2.open_pool(name)
            await barrier(s2.lanes[0], region, [(0, b"new session")])
            assert await s2.lanes[0].read(region, 0, 11) == b"new session"

    run(main)
    assert "internal error" not in t.proc.log_text()


# --------------------------------------------------------------------------- 5. spin and idle


def test_no_spinning_and_an_idle_lane_is_closed(scratch: Path) -> None:
    t = Running(scratch, extra=["--spin-us", "0", "--idle-timeout", "1"])
    name = pool_name()
    try:

        async def main() -> None:
            async with await session(t, lanes=2) as s:
                region = await s.create_pool(name, POOL)
                idle, busy = s.lanes
                # Without spinning every frame is waited for in poll(2): all still complete.
                for i in range(30):
                    lane = s.lanes[i % 2]
                    data = f"barrier {i}".encode()
                    await barrier(lane, region, [(i * 64, data)], "apm" if i % 3 == 0 else "gpspm")
                    assert await lane.read(region, i * 64, len(data)) == data
                # The first lane idles past the timeout; the control connection and the second
                # lane keep busy meanwhile.
                for i in range(8):
                    await trio.sleep(0.25)
                    await s.stats(name)
                    await barrier(busy, region, [(4096 + i, b"k")])
                with pytest.raises(TransportError) as err:
                    await barrier(idle, region, [(0, b"too late")])
                assert err.value.lane_lost and idle.closed
                await barrier(busy, region, [(8192, b"busy lane")])
                assert await busy.read(region, 8192, 9) == b"busy lane"

            async with await session(t) as fresh:
                region = await fresh.open_pool(name)
                await barrier(fresh.lanes[0], region, [(0, b"fresh")])
                assert await fresh.lanes[0].read(region, 0, 5) == b"fresh"

        run(main)
        assert pread(t.pool_dir / name, 8192, 9) == b"busy lane"
    finally:
        log = t.finish()
    assert "closing lane idle for 1s" in log, log
    assert log.count("closing lane idle") == 1, log


def test_a_lane_stops_spinning_on_a_cpu_another_thread_wants(scratch: Path) -> None:
    """After a frame a lane polls for the next one for --spin-us, but not on a CPU another
    thread wants: a program that runs a moment between system calls, never runnable when the
    lane yields, still preempts it, and that ends the spin (and the next ones)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: the lane's and everything else's")
    cpu, rest = cpus[0], cpus[1:]
    t = Running(scratch, extra=["--spin-us", "2000"])
    proc = t.proc.proc
    assert proc is not None
    # The lane thread alone on its CPU: the target's own loop, and this process sending the
    # frames, would preempt it there themselves.
    pin_process(proc.pid, *rest)
    pin_process(os.getpid(), *rest)
    name = pool_name()
    try:

        async def main() -> None:
            async with await session(t) as s:
                lane = s.lanes[0]
                region = await s.create_pool(name, POOL)
                await barrier(lane, region, [(0, b"first")])  # its C thread runs now
                tids = [tid for tid in os.listdir(f"/proc/{proc.pid}/task")
                        if Path(f"/proc/{proc.pid}/task/{tid}/comm").read_text().strip() == "rpm_lane_serve"]
                assert len(tids) == 1, tids
                tid = int(tids[0])
                os.sched_setaffinity(tid, {cpu})

                async def spun(what: bytes) -> float:
                    """The lane's CPU time over 0.5 s of a barrier every 3 ms: alone on its
                    CPU it spins 2 ms after each."""
                    before = cpu_seconds(proc.pid, tid)
                    end = time.monotonic() + 0.5
                    i = 0
                    while time.monotonic() < end:
                        await barrier(lane, region, [(64 * (i % 100), what)])
                        await trio.sleep(0.003)
                        i += 1
                    return cpu_seconds(proc.pid, tid) - before

                # A kernel thread on that CPU now and then ends a spin too, and two in a row
                # stop the spinning for 50 ms: one window of four is enough.
                alone = [await spun(b"alone") for _ in range(4)]
                assert max(alone) > 0.1, f"the lane did not spin with its CPU idle ({alone}s of 0.5)"
                with cpu_wanted(cpu):
                    busy = await spun(b"contended")
                assert busy < 0.05, f"the lane spun {busy:.3f}s of 0.5 on a CPU another thread wanted"
                assert await lane.read(region, 0, 9) == b"contended"

        run(main)
    finally:
        pin_process(os.getpid(), *cpus)
        t.finish()


# --------------------------------------------------------------------------- 6. SIGTERM


def test_sigterm_with_lanes_waiting_in_c_threads_exits_cleanly(scratch: Path) -> None:
    t = Running(scratch)
    name = pool_name()
    proc = t.proc.proc
    assert proc is not None

    async def main() -> None:
        s = await session(t, lanes=3)
        region = await s.create_pool(name, 4 * MiB)
        for n, lane in enumerate(s.lanes):
            await barrier(lane, region, [(n * 4096, f"lane {n}".encode())])
        # One more lane stuck inside a frame, in recv() straight into the mapping.
        raw = await trio.to_thread.run_sync(raw_lane, t.address, s.session_id)
        try:
            raw.send(hdr(Op.WRITE, region.key, MiB, 2 * MiB) + b"z" * 100_000)
            with trio.fail_after(10):
                while pread(t.pool_dir / name, MiB, 8) != b"z" * 8:
                    await trio.sleep(0.01)
            await trio.sleep(0.3)  # past the spin: the lanes sleep in poll(2)
            proc.send_signal(signal.SIGTERM)
            try:
                code = await trio.to_thread.run_sync(proc.wait, 10)
            except Exception:
                pytest.fail("target did not exit within 10 s of SIGTERM with lanes in C threads")
            assert code == 0
            with pytest.raises(TransportError):
                await barrier(s.lanes[0], region, [(0, b"too late")])
        finally:
            raw.close()
            await s.aclose()

    run(main)
    log = t.finish()
    assert "received SIGTERM" in log and "target stopped" in log
    for n in range(3):
        assert pread(t.pool_dir / name, n * 4096, 6) == f"lane {n}".encode()


# --------------------------------------------------------------------------- 7. split frames


def _dribble(raw: RawConn, data: bytes, rng: random.Random, small: bool) -> None:
    """Each piece of ``data`` in a record of its own (frames cut across records), and each
    record in two sends (records cut across segments)."""
    assert raw.records is not None
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 7) if small else rng.randint(1, 3000)
        record = raw.records.seal(data[pos : pos + n])
        cut = rng.randint(1, len(record) - 1)
        raw.sock.sendall(record[:cut])
        time.sleep(0.0002)
        raw.sock.sendall(record[cut:])
        pos += n
        time.sleep(0.0005 if small else 0.0002)


def test_frames_split_into_tiny_sends_are_placed_and_truncation_is_logged(
    targets: Callable[..., Running],
) -> None:
    # At debug level every line is logged: repeats are not held back (rpmemfs/logs.py), so each
    # truncated connection has its line to count.
    t = targets("gpspm", "--log-level", "debug")
    rng = random.Random("tiny sends")
    ctl, key, sid, name = raw_session(t.address)
    by_ctl, by_key, by_sid, _ = raw_session(t.address)
    bystander = raw_lane(t.address, by_sid)
    lane = raw_lane(t.address, sid)
    try:
        small = rng.randbytes(1000)
        large = rng.randbytes(40 * KiB)
        value = rng.getrandbits(64)
        # Small frames a few bytes at a time: headers and payloads cut anywhere, the next
        # header starting in the same send as the previous payload's tail.
        head = (hdr(Op.WRITE, key, 3, len(small), id_=1) + small
                + hdr(Op.ATOMIC_WRITE, key, 2048, id_=2, imm=value)
                + hdr(Op.WRITE, key, 5000, 5, id_=3) + b"fives")
        tail = (flush_frame(key, [(3, len(small)), (5000, 5), (2048, 8), (8191, len(large))], 4)
                + hdr(Op.READ, key, 0, 8 * KiB, id_=5)
                + hdr(Op.READ, key, 0, 8, id_=6, flags=F_FLUSH))
        _dribble(lane, head, rng, small=True)
        # A large payload in sends of up to 3000 bytes, its header cut in two.
        frame = hdr(Op.WRITE, key, 8191, len(large), id_=7) + large
        _dribble(lane, frame[:13], rng, small=True)
        _dribble(lane, frame[13:], rng, small=False)
        _dribble(lane, tail, rng, small=True)
        expect = bytearray(8 * KiB)
        expect[3 : 3 + len(small)] = small
        expect[2048:2056] = value.to_bytes(8, "little")
        expect[5000:5005] = b"fives"
        expect[8191:] = large[:1]
        assert expect_frame(lane, Op.SEND_REPLY, 4) == b""
        assert_same(expect_frame(lane, Op.READ_RESP, 5), expect, "read after split frames")
        assert len(expect_frame(lane, Op.READ_RESP, 6)) == 8
        path = t.pool_dir / name
        assert_same(pread(path, 0, 8 * KiB), expect, "pool file head")
        assert_same(pread(path, 8191, len(large)), large, "pool file, large write")
        stats = ctl.control({"op": "stats", "name": name})["pools"][name]
        assert (stats["writes"], stats["bytes"], stats["atomics"], stats["flushes"], stats["reads"]) == (
            3, len(small) + 5 + len(large), 1, 2, 1), stats

        # Connections that end in the middle of a frame: logged as truncated, nothing else hurt.
        before = t.proc.log_text().count(TRUNCATED)
        # (A truncated WRITE may leave what it received placed: they write past 128 KiB.)
        cuts = [
            hdr(Op.WRITE, key, 128 * KiB, 4)[:10],
            hdr(Op.WRITE, key, 128 * KiB, 100) + b"short",
            hdr(Op.WRITE, key, 128 * KiB, 512 * KiB) + b"y" * 100_000,
            flush_frame(key, [(0, 8)] * 10)[:60],
            hdr(Op.READ, key, 0, 8, id_=9) + hdr(Op.WRITE, key, 128 * KiB, 8)[:31],
        ]
        for n, data in enumerate(cuts):
            cut = raw_lane(t.address, sid)
            _dribble(cut, data[:40], rng, small=True)
            cut.send(data[40:])
            if data[0] == Op.READ:
                # Consumed, so that our close is a FIN, not a reset for unread data.
                assert expect_frame(cut, Op.READ_RESP, 9) == bytes(expect[:8])
            time.sleep(0.05)
            cut.close()
            raw_roundtrip(bystander, by_key, 64 * n, f"bystander {n}".encode(), 100 + 2 * n)
            raw_roundtrip(lane, key, 64 * KiB + 64 * n, f"same session {n}".encode(), 100 + 2 * n)
        assert wait_for(lambda: t.proc.log_text().count(TRUNCATED) >= before + len(cuts)), (
            t.proc.log_text()[-3000:])
        assert ctl.control({"op": "info"})["ok"] and by_ctl.control({"op": "info"})["ok"]
    finally:
        for c in (lane, bystander, ctl, by_ctl):
            c.close()


# --------------------------------------------------------------------------- deadlines
#
# Both once failed: a header begun while idle was waited for under the idle deadline, and a
# deadline armed by the Python loop for a handed-off frame outlived it.

def test_a_header_begun_while_idle_is_cut_at_the_frame_deadline(
    targets: Callable[..., Running],
) -> None:
    t = targets("gpspm", "--frame-timeout", "1")
    ctl, key, sid, _ = raw_session(t.address)
    lane = raw_lane(t.address, sid)
    try:
        raw_roundtrip(lane, key, 0, b"fine", 1)
        lane.send(hdr(Op.WRITE, key, 0, 4)[:10])  # then nothing: a stalled header
        lane.sock.settimeout(3)
        try:
            closed = lane.eof()
        except TimeoutError:
            closed = False
        assert closed, "a header stalled for 3 s was not cut by --frame-timeout 1"
    finally:
        lane.close()
        ctl.close()


@pytest.mark.parametrize("trigger", ["large flush list", "non-JSON control request"])
def test_a_busy_lane_outlives_the_frame_deadline_after_a_frame_sent_in_parts(
    targets: Callable[..., Running], trigger: str
) -> None:
    t = targets("gpspm", "--frame-timeout", "1")
    ctl, key, sid, _ = raw_session(t.address)
    lane = raw_lane(t.address, sid)
    try:
        if trigger == "large flush list":
            body = encode_flush([(i * 128, 16) for i in range(LARGE_FLUSH_RANGES)])
            kind, frame_key = SendKind.FLUSH, key
        else:
            body = b"this is not JSON" * 8
            kind, frame_key = SendKind.CONTROL, 0
        # The frame arrives in two parts, so its loop (C for the flush list, Python for the
        # control request) waits for its payload, well within the deadline, then answers it.
        lane.send(hdr(Op.SEND, frame_key, 0, len(body), id_=1, imm=kind) + body[:5])
        time.sleep(0.3)
        lane.send(body[5:])
        expect_frame(lane, Op.SEND_REPLY, 1)
        # Busy for well past the deadline, never idle or mid-frame for long.
        for i in range(8):
            time.sleep(0.2)
            try:
                raw_roundtrip(lane, key, 64, bytes([i]) * 4, 10 + 2 * i)
            except (EOFError, ConnectionResetError):
                pytest.fail(f"the busy lane was closed {0.2 * (i + 1):.1f} s after the {trigger}")
    finally:
        lane.close()
        ctl.close()
