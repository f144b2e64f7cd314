"""Transport-level behaviour, written once and run over both transports: TCP (the software
transport, here on the host) and verbs (pyverbs over Soft-RoCE, in the VM of
``scripts/test-verbs.sh``, which runs this file with ``-k rdma``). Whatever one transport
promises through the Lane/Session interface, the other must keep.

Each case starts real target daemons: on the host on loopback; in the VM listening on rxe1's
address (so verbs is served on the same port), with the initiator's queue pairs on rxe0.
What a barrier placed is checked by reading the target's pool FILE.
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from rpmemfs.native import ffi
from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport.base import LocalPool, LocalRanges, Session, Transport, TransportError, barrier
from rpmemfs.transport.choose import rdma_devices, transport_for
from rpmemfs.transport.tokens import read_token_file

IN_VM = bool(os.environ.get("RXE_IP_A") and os.environ.get("RXE_IP_B") and rdma_devices())
POOL = 1 << 20
# Python start-up under the VM's software emulation takes seconds.
START_TIMEOUT = 180.0 if IN_VM else 20.0
pytestmark = pytest.mark.timeout(600 if IN_VM else 60)


def _params() -> list[Any]:
    rdma_skip = pytest.mark.skipif(
        not IN_VM, reason="verbs needs RDMA devices: run in the VM (scripts/test-verbs.sh)")
    return [pytest.param("tcp", id="tcp"), pytest.param("rdma", id="rdma", marks=rdma_skip)]


@dataclass
class Env:
    kind: str
    transport: Transport
    targets: dict[str, TargetProcess]  # by method: "apm", "gpspm"
    dirs: dict[str, Path]
    token: bytes  # off loopback (the VM's rxe addresses) a target requires one

    def address(self, method: str) -> str:
        return self.targets[method].address

    def pool_file(self, method: str, name: str) -> Path:
        return self.dirs[method] / name

    async def session(self, method: str, lanes: int = 1) -> Session:
        return await self.transport.connect(self.address(method), self.token, lanes=lanes, timeout=60)


def _token_file(root: Path) -> Path:
    path = root / "token"
    path.write_text(uuid.uuid4().hex + "\n")
    path.chmod(0o600)
    return path


def _target(kind: str, pool_dir: Path, method: str) -> TargetProcess:
    listen = f"{os.environ['RXE_IP_B']}:0" if kind == "rdma" else "127.0.0.1:0"
    extra = dict(pmem="force", persist="apm") if method == "apm" else dict(pmem="msync")
    proc = TargetProcess(pool_dir, listen=listen, log_path=pool_dir.parent / f"{method}.log",
                         token_file=pool_dir.parent / "token", **extra)
    proc.start(timeout=START_TIMEOUT)
    return proc


@pytest.fixture(scope="module", params=_params())
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    kind = request.param
    root = Path(tempfile.mkdtemp(prefix=f"rpmemfs-lanes-{kind}-", dir="/dev/shm"))
    targets: dict[str, TargetProcess] = {}
    dirs: dict[str, Path] = {}
    token = read_token_file(str(_token_file(root)))
    try:
        for method in ("apm", "gpspm"):
            dirs[method] = root / method
            dirs[method].mkdir()
            targets[method] = _target(kind, dirs[method], method)
        src = os.environ.get("RXE_IP_A") if kind == "rdma" else None
        yield Env(kind, transport_for(kind, src), targets, dirs, token)
    finally:
        for t in targets.values():
            t.close()
        shutil.rmtree(root, ignore_errors=True)


class Local:
    """An anonymous mapping standing in for the local pool."""

    def __init__(self, size: int = POOL) -> None:
        self.map = mmap.mmap(-1, size)
        self.buf = memoryview(self.map)
        self.pool = LocalPool(self.buf, ffi.from_buffer(self.buf))


def name() -> str:
    return "l-" + uuid.uuid4().hex[:10]


def pread(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def scattered(rng: random.Random, count: int, size: int = POOL) -> list[tuple[int, int]]:
    """``count`` disjoint ranges: tiny (inline), unaligned, page-sized and larger ones."""
    slot = size // count
    out = []
    for i in range(count):
        length = rng.choice([1, 8, 63, 64, 65, 333, 4096, min(slot - 64, 50_000)])
        length = max(1, min(length, slot - 64))
        out.append((i * slot + rng.randrange(0, slot - length), length))
    return out


@pytest.mark.parametrize("method", ["apm", "gpspm"])
def test_barrier_places_exact_bytes(env: Env, method: str) -> None:
    """post of scattered LocalRanges, then wait: every byte is in the target's pool
    file, and nothing outside the ranges was touched."""
    rng = random.Random(7)
    local = Local()
    pool = name()

    async def main() -> None:
        async with await env.session(method) as s:
            region = await s.create_pool(pool, POOL)
            # An appliance target's barriers end in a native FLUSH where the session has it.
            native = method == "apm" and getattr(s, "native_flush", False)
            assert region.method == ("flush" if native else method)
            lane = s.lanes[0]
            for _ in range(3):
                ranges = scattered(rng, 40)
                for off, n in ranges:
                    local.buf[off : off + n] = rng.randbytes(n)
                await lane.wait(lane.post(region, LocalRanges(local.pool, ranges)))
            assert lane.stats.flushes == 3

    trio.run(main)
    assert pread(env.pool_file(method, pool), 0, POOL) == bytes(local.buf)


@pytest.mark.parametrize("method", ["apm", "gpspm"])
def test_pipelined_barriers_complete_in_order(env: Env, method: str) -> None:
    """Several barriers posted before any is waited for (what concurrent fsyncs do); each
    completes, and the pool holds the last bytes written to each place."""
    rng = random.Random(8)
    local = Local()
    pool = name()

    async def main() -> None:
        async with await env.session(method) as s:
            region = await s.create_pool(pool, POOL)
            lane = s.lanes[0]
            tickets = []
            for i in range(24):  # more than a verbs lane's 16 credits
                ranges = scattered(rng, 5)
                for off, n in ranges:
                    local.buf[off : off + n] = bytes([i + 1]) * n
                tickets.append(lane.post(region, LocalRanges(local.pool, ranges)))
            for t in tickets:
                await lane.wait(t)
            assert lane.stats.flushes == 24

    trio.run(main)
    assert pread(env.pool_file(method, pool), 0, POOL) == bytes(local.buf)


@pytest.mark.parametrize("method", ["apm", "gpspm"])
def test_barriers_waited_for_last_first_with_a_read_among_them(env: Env, method: str) -> None:
    """A barrier's reply is taken in C only when it is the next frame on the lane. Waiting for
    the last of several barriers first, with another task's read posted among them, takes
    the earlier replies through the Python reader (kept for their waiters); every barrier
    and the read complete, polled or waited for, in any order."""
    if env.kind != "tcp":
        # What it checks is the TCP lane's reply path; a verbs lane's completions are reaped
        # by one task at a time (trio refuses a second waiter on its channel's fd).
        pytest.skip("the reply path taken in C is the TCP lane's")
    rng = random.Random(11)
    local = Local()
    pool = name()

    async def main() -> None:
        async with await env.session(method) as s:
            region = await s.create_pool(pool, POOL)
            lane = s.lanes[0]
            await barrier(lane, region, [(0, b"read me back")])
            tickets = []
            got: dict[str, bytes] = {}

            async def read() -> None:
                got["read"] = await lane.read(region, 0, 12)

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    ranges = [r for r in scattered(rng, 4) if r[0] >= 64]
                    for off, n in ranges:
                        local.buf[off : off + n] = bytes([i + 1]) * n
                    tickets.append(lane.post(region, LocalRanges(local.pool, ranges)))
                    if i == 2:
                        nursery.start_soon(read)
                        await trio.testing.wait_all_tasks_blocked()
                await lane.wait(tickets[-1])
            assert got["read"] == b"read me back"
            assert all(lane.poll(t) for t in tickets[:-1])
            assert lane.stats.flushes == 7 and not lane.closed

    trio.run(main)
    assert pread(env.pool_file(method, pool), 64, POOL - 64) == bytes(local.buf[64:])


def test_native_flush_barrier(env: Env) -> None:
    """method "flush" (verbs only): the writes and a native RDMA FLUSH in one chain, where
    both ends have it (rdma-core 45+ and Linux 6.2+: ``VERBS_STACK=flush
    scripts/test-verbs.sh``); elsewhere the lane says so and refuses such a barrier cleanly."""
    if env.kind != "rdma":
        pytest.skip("native RDMA FLUSH is a verbs thing")
    rng = random.Random(9)
    local = Local()
    pool = name()
    missing: list[str] = []

    async def main() -> None:
        async with await env.session("apm") as s:
            region = await s.create_pool(pool, POOL)
            lane = s.lanes[0]
            if not lane.native_flush:  # type: ignore[attr-defined]
                assert region.method == "apm"
                with pytest.raises(TransportError, match="no native RDMA FLUSH"):
                    lane.post(region, LocalRanges(local.pool, [(0, 8)]), "flush")
                missing.append(f"no native FLUSH here (target says flush={s.info.get('flush')})")
                return
            # Chosen by the session itself for an appliance target (RPMEMFS_VERBS_FLUSH unset).
            assert region.method == "flush"
            for _ in range(3):
                ranges = scattered(rng, 40)
                for off, n in ranges:
                    local.buf[off : off + n] = rng.randbytes(n)
                await lane.wait(lane.post(region, LocalRanges(local.pool, ranges)))
            data = rng.randbytes(100)
            local.buf[5000:5100] = data
            await barrier(lane, region, [(5000, data)], "flush")
            await barrier(lane, region, [], "flush")  # nothing written: a FLUSH of 8 bytes
            assert lane.stats.flushes == 5

    trio.run(main)
    if missing:
        pytest.skip(missing[0])
    assert pread(env.pool_file("apm", pool), 0, POOL) == bytes(local.buf)


def test_many_ranges_in_one_barrier(env: Env) -> None:
    """1,500 ranges in one barrier: more than fit one flush message (the range list is
    coalesced) or half a verbs send queue (the chain goes in pieces); still one flush."""
    rng = random.Random(9)
    local = Local()
    pool = name()
    ranges = [(i * 512 + 3, 100) for i in range(1500)]
    for off, n in ranges:
        local.buf[off : off + n] = rng.randbytes(n)

    async def main() -> None:
        async with await env.session("gpspm") as s:
            region = await s.create_pool(pool, POOL)
            lane = s.lanes[0]
            await lane.wait(lane.post(region, LocalRanges(local.pool, ranges)))
            assert lane.stats.flushes == 1
            stats = await s.stats(pool)
            assert stats[pool]["flushes"] == 1, stats

    trio.run(main)
    assert pread(env.pool_file("gpspm", pool), 0, POOL) == bytes(local.buf)


def test_barrier_of_buffers_read_and_atomic(env: Env) -> None:
    """barrier() of plain bytes, read() of them back, an 8-byte atomic write ordered after
    earlier writes, and the general-purpose flush counted once per barrier by the target."""
    pool = name()

    async def main() -> None:
        async with await env.session("gpspm", lanes=2) as s:
            region = await s.create_pool(pool, POOL)
            a, b = s.lanes
            await barrier(a, region, [(100, b"hello"), (5000, b"x" * 70_000), (POOL - 8, b"tailtail")])
            assert await b.read(region, 100, 5) == b"hello"
            assert await b.read(region, 5000, 70_000) == b"x" * 70_000
            await a.atomic_write(region, 4096, 0x1122334455667788)
            await barrier(a, region, [])  # a flush alone, ordered after the atomic write
            assert (await a.read(region, 4096, 8)) == (0x1122334455667788).to_bytes(8, "little")
            stats = (await s.stats(pool))[pool]
            assert stats["flushes"] == 2, stats

    trio.run(main)
    assert pread(env.pool_file("gpspm", pool), POOL - 8, 8) == b"tailtail"


def test_bad_requests_fail_cleanly_and_the_lane_goes_on(env: Env) -> None:
    """Out-of-range writes and reads, a misaligned atomic: TransportError before anything is
    sent, and the same lane serves the next barrier."""
    pool = name()

    async def main() -> None:
        async with await env.session("gpspm") as s:
            region = await s.create_pool(pool, POOL)
            lane = s.lanes[0]
            for bad in (
                barrier(lane, region, [(POOL - 4, b"12345678")]),
                lane.read(region, POOL, 1),
                lane.atomic_write(region, 12, 1),
            ):
                with pytest.raises(TransportError):
                    await bad
            await barrier(lane, region, [(0, b"still here")])
            assert await lane.read(region, 0, 10) == b"still here"
            assert not lane.closed

    trio.run(main)


def test_a_local_barrier_with_a_range_outside_the_pool_is_refused_before_anything_is_sent(env: Env) -> None:
    """The ranges of a barrier from the local pool are checked in C before a byte goes out:
    one outside the region is a TransportError that says which, an empty one is left out,
    and the lane serves the next barrier."""
    local = Local()
    pool = name()

    async def main() -> None:
        async with await env.session("gpspm") as s:
            region = await s.create_pool(pool, POOL // 2)  # smaller than the local pool
            lane = s.lanes[0]
            local.buf[0:5] = b"first"
            with pytest.raises(TransportError, match="outside pool"):
                lane.post(region, LocalRanges(local.pool, [(0, 5), (POOL // 2 - 4, 8)]))
            await lane.wait(lane.post(region, LocalRanges(local.pool, [(0, 5), (64, 0)])))
            assert await lane.read(region, 0, 5) == b"first"
            assert not lane.closed

    trio.run(main)


def test_control_requests(env: Env) -> None:
    """Refused control requests (a hostile pool name, a missing pool) are clean errors and
    the session goes on; a control message sent on a lane gets its answer there."""

    async def main() -> None:
        async with await env.session("gpspm") as s:
            with pytest.raises(TransportError, match="name"):
                await s.create_pool("../escape", POOL)
            with pytest.raises(TransportError):
                await s.open_pool("no-such-pool-" + uuid.uuid4().hex[:6])
            lane: Any = s.lanes[0]
            reply = await lane.request({"op": "info"})
            assert reply["target"] == "rpmemfs"
            region = await s.create_pool(name(), POOL)
            await barrier(lane, region, [(0, b"ok")])

    trio.run(main)


def test_a_vanished_target_fails_the_barrier_in_bounded_time(env: Env, tmp_path: Path) -> None:
    """kill -9 of the target between barriers: the next one ends in TransportError (lane
    lost) within the session's timeout, never a hang."""
    root = Path(tempfile.mkdtemp(prefix="rpmemfs-lanes-kill-", dir="/dev/shm"))
    _token_file(root).write_bytes(env.token + b"\n")
    d = root / "pools"
    d.mkdir()
    proc = _target(env.kind, d, "gpspm")
    local = Local()
    try:
        async def main() -> None:
            session = await env.transport.connect(proc.address, env.token, lanes=1, timeout=20)
            try:
                region = await session.create_pool(name(), POOL)
                lane = session.lanes[0]
                await lane.wait(lane.post(region, LocalRanges(local.pool, [(0, 4096)])))
                assert proc.proc is not None
                os.kill(proc.proc.pid, signal.SIGKILL)
                proc.proc.wait()
                with trio.fail_after(120), pytest.raises(TransportError) as info:
                    await lane.wait(lane.post(region, LocalRanges(local.pool, [(4096, 4096)])))
                assert info.value.lane_lost
            finally:
                with trio.CancelScope(shield=True):
                    try:
                        await session.aclose()
                    except (TransportError, OSError):
                        pass

        trio.run(main)
    finally:
        proc.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(IN_VM, reason="about a node without RDMA")
def test_rdma_where_there_is_none_is_a_clean_error() -> None:
    """rdma:// on a node without an RDMA device (or without pyverbs): TransportError saying
    so, before any connection; "auto" falls back to TCP (the rest of this file, on the host)."""

    async def main() -> None:
        with pytest.raises(TransportError, match="RDMA|pyverbs"):
            await transport_for("rdma").connect("127.0.0.1:1", None, lanes=1, timeout=5)

    trio.run(main)
