"""Barriers over real verbs between two processes: rxe0 (initiator, this process) and rxe1 (a
target process, ``verbs_peer.py target``), both Soft-RoCE devices inside the VM.

Run them with ``scripts/test-verbs.sh`` (or ``vm/run.sh vm/venv/bin/python -m pytest -q
tests/verbs``); anywhere without pyverbs, RDMA devices and RXE_IP_A/RXE_IP_B they skip.

Every wait here is trio waiting for a file descriptor (the completion channel's, the rdmacm
event channel's) with a deadline, the way the project's trio code has to drive verbs.
"""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytest.importorskip("pyverbs", reason="pyverbs is not importable (Debian's python3-pyverbs)")
pytest.importorskip("trio")

import trio  # noqa: E402
import verbs_peer as vp  # noqa: E402
from pyverbs.cmid import AddrInfo  # noqa: E402
from pyverbs.cq import WC  # noqa: E402
from pyverbs.device import Context  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.pyverbs_error import PyverbsRDMAError  # noqa: E402
from pyverbs.wr import SendWR  # noqa: E402

from rpmemfs.transport.rdma import ce, e  # noqa: E402  (pyverbs' enums, either version's names)

IP_A = os.environ.get("RXE_IP_A", "")
IP_B = os.environ.get("RXE_IP_B", "")
pytestmark = pytest.mark.skipif(
    not (vp.rdma_devices() and IP_A and IP_B),
    reason="needs RDMA devices and RXE_IP_A/RXE_IP_B: run it in the VM (scripts/test-verbs.sh)",
)

POOL_SIZE = 1 << 20
TARGET_PORT = 7471
VANISHING_TARGET_PORT = 7472
READY_TIMEOUT = 120.0  # a Python process start-up under TCG takes seconds
CONNECT_TIMEOUT = 60.0
BARRIER_TIMEOUT = 30.0
PEER_LOSS_BOUND = 60.0  # what "a clean error within a bounded time" means here

READ_ID = 900
SEND_ID = 901
REPLY_ID = 902
REQUEST_OFFSET = 0  # in the initiator's message buffer
REPLY_OFFSET = vp.MSG_SIZE


def make_pool(tag: str) -> Path:
    """A zero-filled 1 MiB file in /dev/shm, standing in for a pool."""
    fd, name = tempfile.mkstemp(prefix=f"verbs-{tag}-", dir="/dev/shm")
    os.ftruncate(fd, POOL_SIZE)
    os.close(fd)
    return Path(name)


class TargetProcess:
    """``verbs_peer.py target`` in a process of its own, listening on RXE_IP_B (``extra``:
    more of its arguments, e.g. "flush")."""

    def __init__(self, port: int, pool: Path, *extra: str) -> None:
        self.port = port
        self.pool = pool
        self.proc = subprocess.Popen(
            [sys.executable, vp.__file__, "target", IP_B, str(port), str(pool), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.kill()
            raise RuntimeError(f"the target did not start (exit status {self.proc.returncode}): {line!r}")

    def stop(self) -> int:
        """Close its standard input, which tells it to exit; its exit status."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    pool = make_pool("pool")
    proc = TargetProcess(TARGET_PORT, pool)
    yield proc
    status = proc.stop()
    pool.unlink()
    assert status == 0, f"the target exited with status {status}"


async def readable_any(fds: Sequence[int]) -> None:
    """Return once one of ``fds`` is readable."""
    async with trio.open_nursery() as nursery:

        async def watch(fd: int) -> None:
            await trio.lowlevel.wait_readable(fd)
            nursery.cancel_scope.cancel()

        for fd in fds:
            nursery.start_soon(watch, fd)


class PeerLost(vp.VerbsError):
    def __init__(self, event: str) -> None:
        super().__init__(f"the connection went away: {event}")
        self.event = event


class Initiator:
    """One connection to a target; barriers posted as single chains of work requests."""

    ctx: Context
    pd: PD
    stage: MR  # what the writes send, at the offsets they go to
    msgs: MR  # the flush READ's 8 bytes; flush requests and replies
    pool: vp.PoolInfo

    def __init__(self) -> None:
        self.events = vp.EventChannel()
        self.cmid = self.events.create_id()
        self.conn: vp.Conn | None = None

    @classmethod
    async def connect(cls, port: int) -> Initiator:
        self = cls()
        with trio.fail_after(CONNECT_TIMEOUT):
            rai = AddrInfo(src=IP_A, dst=IP_B, dst_service=str(port), port_space=vp.PORT_SPACE)
            self.cmid.resolve_addr(rai, 5000)
            await self.expect(ce.RDMA_CM_EVENT_ADDR_RESOLVED)
            self.cmid.resolve_route(5000)
            await self.expect(ce.RDMA_CM_EVENT_ROUTE_RESOLVED)
            self.ctx = Context(name=vp.device_name(self.cmid))
            self.pd = PD(self.ctx)
            self.conn = vp.Conn(self.cmid, self.ctx, self.pd)
            self.stage = MR(self.pd, POOL_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
            self.msgs = MR(self.pd, 2 * vp.MSG_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
            self.cmid.connect(vp.conn_param(self.conn.qp.qp_num))
            response = await self.expect(ce.RDMA_CM_EVENT_CONNECT_RESPONSE)
            self.pool = vp.PoolInfo.unpack(response.private)
            self.conn.to_state(e.IBV_QPS_RTR)
            self.conn.to_state(e.IBV_QPS_RTS)
            self.cmid.establish()
        return self

    async def expect(self, kind: int) -> vp.Event:
        while (ev := self.events.next()) is None:
            await trio.lowlevel.wait_readable(self.events.fd)
        if ev.kind != kind:
            raise vp.VerbsError(f"expected {vp.CM_NAMES[kind]}, got {ev.name}")
        return ev

    def _writes(self, writes: Sequence[tuple[int, bytes]]) -> list[SendWR]:
        wrs = []
        for i, (offset, data) in enumerate(writes):
            self.stage.write(data, len(data), offset)
            wrs.append(vp.write_wr(i, self.stage, offset, len(data), self.pool.rkey, self.pool.addr + offset))
        return wrs

    def post_read_barrier(self, writes: Sequence[tuple[int, bytes]]) -> None:
        """Appliance method: the writes, then an 8-byte READ of the last one; one chain."""
        assert self.conn is not None
        last = writes[-1][0]
        flush = vp.read_wr(READ_ID, self.msgs, 0, 8, self.pool.rkey, self.pool.addr + last)
        self.conn.post_send_chain([*self._writes(writes), flush])

    def post_send_barrier(self, writes: Sequence[tuple[int, bytes]]) -> None:
        """General-purpose method: the writes, then one SEND listing their ranges; the target
        answers with a SEND once it has msync-ed them."""
        assert self.conn is not None
        # The reply's receive goes first: a reply that found none would be an RNR retry.
        self.conn.post_recv(self.msgs, REPLY_OFFSET, vp.MSG_SIZE, REPLY_ID)
        request = vp.pack_flush([(offset, len(data)) for offset, data in writes])
        self.msgs.write(request, len(request), REQUEST_OFFSET)
        flush = vp.send_wr(SEND_ID, self.msgs, REQUEST_OFFSET, len(request), signaled=False)
        self.conn.post_send_chain([*self._writes(writes), flush])

    async def wait(self, timeout: float = BARRIER_TIMEOUT, *, events: bool = True) -> list[WC]:
        """The completions, once there is one; PeerLost if an rdmacm event (DISCONNECTED)
        comes first. Waits on both descriptors, so a vanished peer cannot hang it."""
        assert self.conn is not None
        fds = [self.conn.fd, self.events.fd] if events else [self.conn.fd]
        with trio.fail_after(timeout):
            while True:
                wcs = self.conn.completions()
                if wcs:
                    return wcs
                ev = self.events.next() if events else None
                if ev is not None:
                    raise PeerLost(ev.name)
                await readable_any(fds)

    async def wait_for(
        self, wr_id: int, timeout: float = BARRIER_TIMEOUT, *, events: bool = True
    ) -> list[WC]:
        """Completions until the one of ``wr_id`` (after an error, the device reports every
        flushed work request, unsignaled ones too)."""
        wcs: list[WC] = []
        with trio.fail_after(timeout):
            while not any(wc.wr_id == wr_id for wc in wcs):
                wcs += await self.wait(timeout, events=events)
        return wcs

    def reply(self) -> tuple[bytes, int, int]:
        return vp.FLUSH_REPLY.unpack(self.msgs.read(vp.FLUSH_REPLY.size, REPLY_OFFSET))

    def close(self) -> None:
        try:
            self.cmid.disconnect()
        except PyverbsRDMAError:
            pass  # never connected, or already gone
        if self.conn is not None:
            self.conn.close()
            for obj in (self.stage, self.msgs, self.pd, self.ctx):
                obj.close()
        self.cmid.close()
        self.events.close()


def random_writes(rng: random.Random) -> list[tuple[int, bytes]]:
    """Several ranges, page-crossing and unaligned ones among them, the last one tiny (inline)."""
    writes = [
        (rng.randrange(0, 64) * 4096, rng.randbytes(4096)),
        (rng.randrange(300_000, 400_000), rng.randbytes(333)),
        (rng.randrange(500_000, 600_000), rng.randbytes(100_000)),
        (rng.randrange(700_000, 800_000), rng.randbytes(2 * vp.MAX_INLINE + 1)),
        (rng.randrange(900_000, POOL_SIZE - 8), rng.randbytes(8)),
    ]
    assert len(writes[-1][1]) <= vp.MAX_INLINE < len(writes[-2][1])
    return writes


def assert_in_pool(pool: Path, writes: Sequence[tuple[int, bytes]]) -> None:
    with open(pool, "rb") as f:
        for offset, data in writes:
            f.seek(offset)
            got = f.read(len(data))
            assert got == data, f"pool bytes at {offset} (+{len(data)}) are not what was written"


def test_rxe_pair() -> None:
    """The VM's two Soft-RoCE devices are there and their ports are up."""
    assert {os.environ.get("RXE_DEV_A"), os.environ.get("RXE_DEV_B")} <= set(vp.rdma_devices())
    for dev in (os.environ["RXE_DEV_A"], os.environ["RXE_DEV_B"]):
        with Context(name=dev) as ctx:
            assert ctx.query_port(1).state == e.IBV_PORT_ACTIVE, dev


def test_read_barrier_places_writes(target: TargetProcess) -> None:
    """Unsignaled WRITEs and one signaled 8-byte READ as one chain: exactly one completion,
    after which every written byte is in the target's file."""
    rng = random.Random(1)

    async def run() -> None:
        ini = await Initiator.connect(target.port)
        try:
            for _ in range(3):
                writes = random_writes(rng)
                ini.post_read_barrier(writes)
                wcs = await ini.wait()
                assert [(wc.wr_id, wc.opcode) for wc in wcs] == [(READ_ID, e.IBV_WC_RDMA_READ)]
                vp.check(wcs[0], "flush READ")
                assert ini.msgs.read(8, 0) == writes[-1][1][:8], "the READ saw the bytes before the writes"
                assert_in_pool(target.pool, writes)
            assert ini.conn is not None and ini.conn.completions() == []
        finally:
            ini.close()

    trio.run(run)


def test_send_barrier_msyncs_ranges(target: TargetProcess) -> None:
    """WRITEs then one SEND with the range list; the target msyncs them and answers with a
    SEND, the one completion the initiator waits for."""
    rng = random.Random(2)

    async def run() -> None:
        ini = await Initiator.connect(target.port)
        try:
            for _ in range(2):
                writes = random_writes(rng)
                ini.post_send_barrier(writes)
                wcs = await ini.wait()
                assert [(wc.wr_id, wc.opcode) for wc in wcs] == [(REPLY_ID, e.IBV_WC_RECV)]
                vp.check(wcs[0], "flush reply")
                magic, status, synced = ini.reply()
                assert (magic, status) == (b"DONE", 0)
                assert synced >= sum(len(data) for _, data in writes)
                assert_in_pool(target.pool, writes)
        finally:
            ini.close()

    trio.run(run)


def test_vanished_peer_fails_cleanly() -> None:
    """kill -9 of the target: the next barrier ends in an error (a failed completion or an
    rdmacm DISCONNECTED event) within a bound, never a hang; then the outstanding work
    requests are flushed and the connection closes."""
    pool = make_pool("vanish")
    proc = TargetProcess(VANISHING_TARGET_PORT, pool)
    rng = random.Random(3)
    outcome: dict[str, object] = {}

    async def run() -> None:
        ini = await Initiator.connect(VANISHING_TARGET_PORT)
        try:
            writes = random_writes(rng)
            ini.post_read_barrier(writes)
            vp.check((await ini.wait())[0], "barrier before the kill")
            proc.kill()
            start = time.monotonic()
            ini.post_read_barrier(random_writes(rng))
            try:
                wcs = await ini.wait_for(READ_ID, PEER_LOSS_BOUND)
            except PeerLost as lost:
                outcome["event"] = lost.event
                assert ini.conn is not None
                ini.conn.to_error()
                wcs = await ini.wait_for(READ_ID, events=False)
            outcome["completions"] = [vp.WC_NAMES.get(wc.status, wc.status) for wc in wcs]
            assert all(wc.status != e.IBV_WC_SUCCESS for wc in wcs), "a barrier to a dead target succeeded"
            outcome["seconds"] = round(time.monotonic() - start, 2)
        finally:
            ini.close()

    try:
        trio.run(run)
    finally:
        if proc.proc.returncode is None:
            proc.kill()
        pool.unlink()
    print(f"peer loss seen as {outcome}")
    assert float(str(outcome["seconds"])) < PEER_LOSS_BOUND
