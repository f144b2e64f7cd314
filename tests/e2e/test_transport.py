"""The TCP transport against real target daemons: placement, flushes, ordering, lanes, errors.

Every target is a real `python -m rpmemfs.target` process on loopback with its pools on
/dev/shm; what a barrier left on the target is checked by reading the pool FILE directly.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import rawwire
import trio

from rpmemfs.fs.mkfs import mkfs
from rpmemfs.pool.layout import Header
from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport import RemoteRegion, TcpSession, TransportError, barrier, connect
from rpmemfs.transport.wire import HELLO_SIZE, Frame, Op

pytestmark = pytest.mark.timeout(60)

POOL = 1 << 20


def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return trio.run(fn, *args)


def pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def pool_name() -> str:
    return "t-" + uuid.uuid4().hex[:12]


class Target:
    def __init__(self, proc: TargetProcess, pool_dir: Path) -> None:
        self.proc = proc
        self.pool_dir = pool_dir

    @property
    def address(self) -> str:
        return self.proc.address


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-transport-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _start(scratch: Path, name: str, **kw: Any) -> Iterator[Target]:
    pool_dir = scratch / name
    pool_dir.mkdir()
    proc = TargetProcess(pool_dir, **kw)
    proc.start()
    try:
        yield Target(proc, pool_dir)
    finally:
        code = proc.stop()
        log = proc.log_text()
        proc.close()
        assert code == 0, log
        assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def gpspm_target(scratch: Path) -> Iterator[Target]:
    """The default: general-purpose method, pools mapped with msync (tmpfs is not DAX)."""
    yield from _start(scratch, "gpspm")


@pytest.fixture(scope="module")
def apm_target(scratch: Path) -> Iterator[Target]:
    yield from _start(scratch, "apm", persist="apm", pmem="force")


@pytest.fixture(params=["apm", "gpspm"])
def target(request: pytest.FixtureRequest) -> Target:
    t: Target = request.getfixturevalue(f"{request.param}_target")
    return t


async def _session(t: Target, lanes: int = 1) -> TcpSession:
    return await connect(t.address, None, lanes=lanes, timeout=10)


def test_barrier_places_exact_bytes_in_the_pool_file(target: Target) -> None:
    name = pool_name()
    writes = [(0, b"head"), (4096, os.urandom(5000)), (POOL - 16, b"0123456789abcdef")]

    async def main() -> RemoteRegion:
        async with await _session(target) as s:
            region = await s.create_pool(name, POOL)
            assert region.size == POOL and region.uuid is None
            assert region.method == s.info["method"]
            await barrier(s.lanes[0], region, writes)
            return region

    region = run(main)
    path = target.pool_dir / name
    assert path.stat().st_size == POOL
    expected = bytearray(POOL)
    for off, data in writes:
        expected[off : off + len(data)] = data
    assert pread(path, 0, POOL) == bytes(expected)
    assert region.method in ("apm", "gpspm")


@pytest.mark.parametrize("method", ["apm", "gpspm"])
def test_both_flush_ops_work_after_posted_writes(gpspm_target: Target, method: str) -> None:
    name = pool_name()
    data = os.urandom(3000)

    async def main() -> None:
        async with await _session(gpspm_target) as s:
            region = await s.create_pool(name, POOL)
            lane = s.lanes[0]
            await lane.post_writes(region, [(100, data)])
            if method == "apm":
                await lane.flush_read(region)
            else:
                await lane.flush_send(region, [(100, len(data))])
            stats = (await s.stats(name))[name]
            assert stats["writes"] == 1 and stats["bytes"] == len(data) and stats["flushes"] == 1

    run(main)
    assert pread(gpspm_target.pool_dir / name, 100, len(data)) == data


def test_many_ranges_in_one_barrier_go_out_in_one_send(target: Target) -> None:
    name = pool_name()
    rng = random.Random(7)
    # 300 disjoint ranges of assorted sizes, in random order.
    slots = rng.sample(range(POOL // 2048), 300)
    writes = [(slot * 2048 + rng.randrange(64), rng.randbytes(rng.randrange(1, 600))) for slot in slots]

    async def main() -> None:
        async with await _session(target) as s:
            region = await s.create_pool(name, POOL)
            lane = s.lanes[0]
            before = lane.stats.sendmsgs, lane.stats.batches
            await barrier(lane, region, writes)
            # One sendmsg: 300 x (header + payload) + the flush, as 601 or 602 buffers.
            assert (lane.stats.sendmsgs, lane.stats.batches) == (before[0] + 1, before[1] + 1)
            stats = (await s.stats(name))[name]
            assert stats["writes"] == len(writes)
            assert stats["bytes"] == sum(len(d) for _, d in writes)
            assert stats["flushes"] == 1

    run(main)
    path = target.pool_dir / name
    for off, data in writes:
        assert pread(path, off, len(data)) == data


def test_exactly_one_flush_per_barrier(target: Target) -> None:
    name = pool_name()
    barriers = 25

    async def main() -> None:
        async with await _session(target) as s:
            region = await s.create_pool(name, POOL)
            lane = s.lanes[0]
            for i in range(barriers):
                await barrier(lane, region, [(i * 8192, b"a" * 4096), (i * 8192 + 4096, b"b" * 100)])
            stats = (await s.stats(name))[name]
            assert stats["flushes"] == barriers
            assert stats["writes"] == 2 * barriers
            assert stats["reads"] == 0
            assert lane.stats.flushes == barriers

    run(main)


def test_write_then_read_on_a_lane_sees_the_new_bytes(target: Target) -> None:
    name = pool_name()

    async def main() -> None:
        async with await _session(target) as s:
            region = await s.create_pool(name, POOL)
            lane = s.lanes[0]
            for i in range(50):
                data = os.urandom(64 + i * 37)
                off = (i * 4099) % (POOL - len(data))
                # No flush in between: the READ itself is ordered after the WRITE.
                await lane.post_writes(region, [(off, data)])
                assert await lane.read(region, off, len(data)) == data

    run(main)


def test_large_write_goes_straight_into_the_pool(gpspm_target: Target) -> None:
    name = pool_name()
    size = 8 << 20
    data = os.urandom(3 << 20)

    async def main() -> None:
        async with await _session(gpspm_target) as s:
            region = await s.create_pool(name, size)
            await barrier(s.lanes[0], region, [(4096 + 1, data)])
            assert await s.lanes[0].read(region, 4097, len(data)) == data

    run(main)
    assert pread(gpspm_target.pool_dir / name, 4097, len(data)) == data


def test_several_lanes_concurrently(target: Target) -> None:
    name = pool_name()
    lanes, rounds, stripe = 4, 20, POOL // 4

    async def worker(lane_no: int, s: TcpSession, region: RemoteRegion) -> None:
        lane = s.lanes[lane_no]
        for r in range(rounds):
            data = bytes([lane_no + 1]) * 1000 + r.to_bytes(4, "little")
            await barrier(lane, region, [(lane_no * stripe + r * 1024, data)])

    async def main() -> None:
        async with await _session(target, lanes=lanes) as s:
            region = await s.create_pool(name, POOL)
            async with trio.open_nursery() as nursery:
                for n in range(lanes):
                    nursery.start_soon(worker, n, s, region)
            stats = (await s.stats(name))[name]
            assert stats["flushes"] == lanes * rounds

    run(main)
    path = target.pool_dir / name
    for n in range(lanes):
        for r in range(rounds):
            got = pread(path, n * stripe + r * 1024, 1004)
            assert got == bytes([n + 1]) * 1000 + r.to_bytes(4, "little")


def test_atomic_write(target: Target) -> None:
    name = pool_name()

    async def main() -> None:
        async with await _session(target) as s:
            region = await s.create_pool(name, POOL)
            lane = s.lanes[0]
            await lane.atomic_write(region, 64, 0x0102030405060708)
            assert await lane.read(region, 64, 8) == (0x0102030405060708).to_bytes(8, "little")
            await lane.atomic_write(region, POOL - 8, (1 << 64) - 1)
            await lane.flush_send(region, [(64, 8), (POOL - 8, 8)])
            with pytest.raises(TransportError, match="not 8-byte aligned"):
                await lane.atomic_write(region, 65, 1)
            assert not lane.closed
            assert (await s.stats(name))[name]["atomics"] == 2

    run(main)
    path = target.pool_dir / name
    assert pread(path, 64, 8) == bytes.fromhex("0807060504030201")
    assert pread(path, POOL - 8, 8) == b"\xff" * 8


def test_out_of_range_requests_fail_cleanly_and_the_lane_goes_on(gpspm_target: Target) -> None:
    name = pool_name()

    async def main() -> None:
        async with await _session(gpspm_target) as s:
            region = await s.create_pool(name, POOL)
            lane = s.lanes[0]
            with pytest.raises(TransportError, match="outside pool") as err:
                await lane.read(region, 0, POOL + 1)
            assert not err.value.lane_lost and err.value.peer == gpspm_target.address
            with pytest.raises(TransportError, match="outside pool"):
                await lane.post_writes(region, [(POOL - 2, b"abc")])
            with pytest.raises(TransportError, match="outside pool"):
                await lane.flush_send(region, [(POOL, 1)])
            assert not lane.closed
            await barrier(lane, region, [(0, b"still fine")])
            assert await lane.read(region, 0, 10) == b"still fine"

    run(main)


def test_refused_control_requests_leave_the_session_working(gpspm_target: Target) -> None:
    name = pool_name()

    async def main() -> None:
        async with await _session(gpspm_target) as s:
            with pytest.raises(TransportError, match="does not exist") as err:
                await s.open_pool(name)
            assert not err.value.lane_lost
            region = await s.create_pool(name, POOL)
            with pytest.raises(TransportError, match="already exists"):
                await s.create_pool(name, POOL)
            with pytest.raises(TransportError, match="is open"):
                await s.remove_pool(name)
            with pytest.raises(TransportError, match="multiple of 4096"):
                await s.create_pool(pool_name(), 1000)
            await barrier(s.lanes[0], region, [(0, b"ok")])
            await s.close_pool(region)
            await s.remove_pool(name)
            assert not (gpspm_target.pool_dir / name).exists()

    run(main)


def test_a_lane_closed_by_the_target_fails_alone(gpspm_target: Target) -> None:
    name = pool_name()

    async def main() -> None:
        async with await _session(gpspm_target, lanes=2) as s:
            region = await s.create_pool(name, POOL)
            stale = await s.open_pool(name)
            await s.close_pool(stale)
            # The target no longer knows that key: like a remote access error on a queue
            # pair, the lane that used it is closed, with the reason.
            with pytest.raises(TransportError, match="unregistered key") as err:
                await barrier(s.lanes[0], stale, [(0, b"x")])
            assert err.value.lane_lost and s.lanes[0].closed
            with pytest.raises(TransportError, match="unregistered key"):
                await s.lanes[0].read(region, 0, 1)
            await barrier(s.lanes[1], region, [(0, b"other lane")])
            fresh = await s.open_lane()
            assert await fresh.read(region, 0, 10) == b"other lane"

    run(main)


def test_a_replicated_pool_reopens_with_its_uuid(gpspm_target: Target, scratch: Path) -> None:
    """The initiator writes a whole pool; reopened, the target reports the pool's own uuid."""
    name = pool_name()
    local = scratch / f"{name}.local"
    hdr = mkfs(str(local), 4 << 20)
    image = local.read_bytes()

    async def main() -> None:
        async with await _session(gpspm_target) as s:
            region = await s.create_pool(name, len(image))
            await barrier(s.lanes[0], region, [(0, image)])
            await s.close_pool(region)
            again = await s.open_pool(name)
            assert again.uuid == hdr.uuid

    run(main)
    assert Header.decode(pread(gpspm_target.pool_dir / name, 0, 4096)).uuid == hdr.uuid
    assert (gpspm_target.pool_dir / name).read_bytes() == image


SILENT_TOKEN = b"the silent target's token"


async def _silent_target(listener: trio.socket.SocketType) -> None:
    """Completes the handshake like a target (SILENT_TOKEN), then reads and never answers."""

    async def exactly(sock: trio.socket.SocketType, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await sock.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    async def serve(sock: trio.socket.SocketType) -> None:
        with sock:
            challenge, records = rawwire.challenge_for(SILENT_TOKEN, await exactly(sock, HELLO_SIZE))
            await sock.send(challenge)
            await exactly(sock, 64)  # AUTH header + proof: this peer believes anyone
            assert records is not None
            ok = b"s" * 16 + b'{"method": "gpspm"}'
            await sock.send(records.seal(Frame(Op.OK, length=len(ok)).pack() + ok))
            while await sock.recv(65536):
                pass

    async with trio.open_nursery() as nursery:
        while True:
            sock, _ = await listener.accept()
            nursery.start_soon(serve, sock)


def test_a_silent_target_hits_the_deadline_and_loses_the_lane() -> None:
    fake = RemoteRegion(name="fake", key=1, size=1 << 20, uuid=None, method="gpspm", pmem="msync")

    async def main() -> None:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_silent_target, listener)
            s = await connect(address, SILENT_TOKEN, lanes=2, timeout=0.5)
            started = trio.current_time()
            with pytest.raises(TransportError, match="timed out after 0.5s") as err:
                await barrier(s.lanes[0], fake, [(0, b"x" * 100)])
            assert 0.4 < trio.current_time() - started < 3
            assert err.value.lane_lost and s.lanes[0].closed
            # Cancelled from outside mid-flush: the reply may still come, so the lane is lost.
            with trio.move_on_after(0.1):
                await barrier(s.lanes[1], fake, [(0, b"y")])
            assert s.lanes[1].closed
            with pytest.raises(TransportError, match="cancelled"):
                await s.lanes[1].read(fake, 0, 1)
            await s.aclose()
            nursery.cancel_scope.cancel()

    run(main)
