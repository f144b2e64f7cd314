"""A transport in memory, for the unit tier: targets whose pools are bytearrays, in this process.

It implements rpmemfs.transport.base's Protocols (Transport, Session, Lane, Ticket) the way the
replica set uses them, with the same semantics as TCP where it matters: writes posted on a lane
are placed in order, a barrier's one flush completes after them, replies are matched to their
request (so they may arrive in any order), a refusal is a TransportError with the lane intact,
and a lost connection or a missed deadline is one with ``lane_lost``.

Each ``MemTarget`` can be told to misbehave, at any time:

- ``hang()``: accept requests and never answer them (nor place them), until ``resume()``;
- ``delay(seconds)`` / ``reply_delays([...])``: answer each flush that much later (one delay
  per flush, in posting order: a shorter delay for a later barrier answers it first);
- ``fail_flushes(n, reason, after)``: answer the n flushes after the next ``after`` with an error;
- ``drop()``: close every connection now, and refuse new ones until ``restart()``.

Time is trio's, so a test can run under trio.testing.MockClock and a hang costs nothing.
A ticket's ``fd`` is -1: spin() finds no descriptor to wait on and hands over at once, and
completion is read from the ticket itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Self

import trio

from rpmemfs.chunksum import chunk_sums
from rpmemfs.pool.header import find_header
from rpmemfs.target.owners import Owner, refusal
from rpmemfs.transport.base import (
    DEFAULT_TIMEOUT,
    BytesLike,
    Lane,
    LaneStats,
    LocalRanges,
    Method,
    PackedRanges,
    RemoteRegion,
    Session,
    Ticket,
    Transport,
    TransportError,
    Writes,
    check_range,
    unpack,
)

Op = tuple[Any, ...]


class MemTarget:
    """A target daemon in memory: its pools by name, what it was asked, and how it answers."""

    def __init__(self, address: str, method: Method = "gpspm") -> None:
        self.address = address
        self.method: Method = method
        self.pools: dict[str, bytearray] = {}
        # Fencing as the real target does it (rpmemfs/target/owners.py): who claimed each pool.
        self.owners: dict[str, Owner] = {}
        # Every request that reached the target, in order: ("write", pool, offset, length),
        # ("flush", pool), ("read", pool, offset, length), ("checksum", pool, offset, length).
        self.ops: list[Op] = []
        self.connects = 0
        self.attempts: list[float] = []  # when each connection was tried, refused or not
        self.probes = 0  # reachability probes (ReplicaSet.probe) that reached it
        self.sessions: list[MemSession] = []
        self._up = True
        self._hung = False
        self._resumed = trio.Event()  # set (and replaced) whenever a hang ends
        self._delay = 0.0
        self._delays: deque[float] = deque()
        self._errors: deque[str | None] = deque()  # None: a flush that succeeds

    # ---------------------------------------------------------------- misbehaving

    def hang(self) -> None:
        self._hung = True

    def resume(self) -> None:
        self._hung = False
        self._resumed.set()
        self._resumed = trio.Event()

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def reply_delays(self, seconds: Sequence[float]) -> None:
        self._delays.extend(seconds)

    def fail_flushes(self, n: int = 1, reason: str = "persist failed: Input/output error",
                     after: int = 0) -> None:
        self._errors.extend([None] * after + [reason] * n)

    def drop(self) -> None:
        """The target goes away: its connections break, new ones are refused."""
        self._up = False
        for s in self.sessions:
            s.lose("connection lost: reset by peer")
        self.sessions.clear()

    def restart(self) -> None:
        self._up = True
        self._hung = False

    # ---------------------------------------------------------------- serving

    def writes(self, since: int = 0) -> list[tuple[int, int]]:
        """(offset, length) of the writes received from op number ``since`` on."""
        return [(op[2], op[3]) for op in self.ops[since:] if op[0] == "write"]

    def flushes(self, since: int = 0) -> int:
        return sum(1 for op in self.ops[since:] if op[0] == "flush")

    def owner(self, name: str) -> Owner | None:
        """The recorded owner, else (a pool nobody claimed) the epoch in its header."""
        if name in self.owners:
            return self.owners[name]
        hdr = find_header(self.pools[name])
        return Owner(hdr.epoch) if hdr else None

    def _region(self, name: str, key: int) -> RemoteRegion:
        pool = self.pools[name]
        hdr = find_header(pool)
        return RemoteRegion(name, key, len(pool), hdr.uuid if hdr else None, self.method, "force")

    def _reply_at(self) -> float:
        """When the answer to a flush posted now arrives (inf: never)."""
        if self._hung:
            return math.inf
        delay = self._delays.popleft() if self._delays else self._delay
        return trio.current_time() + delay

    async def answer(self, session: MemSession, deadline: float) -> None:
        """Wait as a request to this target does: through a hang and a delay; TransportError
        when the session breaks or ``deadline`` passes first."""
        while self._hung:
            with trio.move_on_at(deadline):
                await self._resumed.wait()
            session.check()
            if trio.current_time() >= deadline:
                session.lose("timed out waiting for the target's reply")
                session.check()
        if self._delay:
            with trio.move_on_at(deadline):
                await trio.sleep(self._delay)
            if trio.current_time() >= deadline:
                session.lose("timed out waiting for the target's reply")
        session.check()


@dataclass(eq=False)
class MemTicket:
    """A posted barrier: when its reply arrives, and what it says."""

    reply_at: float
    error: str | None = None
    done: bool = False


class MemLane:
    """One ordered stream to a MemTarget (rpmemfs.transport.base.Lane)."""

    def __init__(self, session: MemSession) -> None:
        self.session = session
        self.target = session.target
        self.peer = session.peer
        self.stats = LaneStats()

    @property
    def closed(self) -> bool:
        return self.session.lost is not None

    def _place(self, region: RemoteRegion, writes: Sequence[tuple[int, BytesLike]]) -> None:
        """The writes land in the target's pool, in order (unless the target hangs)."""
        self.session.check()
        pool = self.target.pools[region.name]
        for off, data in writes:
            n = len(memoryview(data).cast("B"))
            check_range(self.peer, region, off, n)
            if not n:
                continue
            self.stats.writes += 1
            self.stats.bytes += n
            if not self.target._hung:
                pool[off: off + n] = data
                self.target.ops.append(("write", region.name, off, n))

    def post(self, region: RemoteRegion, writes: Writes, method: Method | None = None) -> MemTicket:
        if isinstance(writes, LocalRanges):
            writes = [(o, writes.pool.buf[o: o + n]) for o, n in writes.ranges]
        elif isinstance(writes, PackedRanges):
            writes = unpack(writes.data, writes.ranges)
        self._place(region, writes)
        self.stats.batches += 1
        error = None
        if not self.target._hung:
            self.target.ops.append(("flush", region.name))
            error = self.target._errors.popleft() if self.target._errors else None
        return MemTicket(self.target._reply_at(), error)

    def poll(self, ticket: Ticket) -> bool:
        assert isinstance(ticket, MemTicket)
        if ticket.done:
            return True
        self.session.check()
        if trio.current_time() < ticket.reply_at:
            return False
        if ticket.error is not None:
            raise TransportError(self.peer, ticket.error, code=5)
        ticket.done = True
        self.stats.flushes += 1
        return True

    async def wait(self, ticket: Ticket) -> None:
        assert isinstance(ticket, MemTicket)
        deadline = trio.current_time() + self.session.timeout
        while not self.poll(ticket):
            if trio.current_time() >= deadline:
                self.session.lose(f"timed out after {self.session.timeout:g}s waiting for the target's reply")
                self.session.check()
            with trio.move_on_at(min(ticket.reply_at, deadline)):
                await self.session.broken.wait()

    async def read(self, region: RemoteRegion, offset: int, length: int) -> bytes:
        check_range(self.peer, region, offset, length)
        self.session.check()
        self.target.ops.append(("read", region.name, offset, length))
        await self.target.answer(self.session, trio.current_time() + self.session.timeout)
        self.stats.reads += 1
        return bytes(self.target.pools[region.name][offset: offset + length])

    async def atomic_write(self, region: RemoteRegion, offset: int, value: int) -> None:
        self._place(region, [(offset, value.to_bytes(8, "little"))])
        self.stats.atomics += 1

    async def send(self, msg: bytes) -> None:
        raise TransportError(self.peer, "control messages are not served in memory")

    async def recv(self) -> bytes:
        raise TransportError(self.peer, "control messages are not served in memory")

    async def aclose(self) -> None:
        self.session.lose("lane closed")


class MemSession:
    """A session with one MemTarget: its lanes share one fate (as they do with TCP when the
    target goes away)."""

    def __init__(self, target: MemTarget, lanes: int, timeout: float) -> None:
        self.target = target
        self.peer = target.address
        self.timeout = timeout
        self.info: Mapping[str, Any] = {"transport": "mem", "method": target.method, "pmem": "force"}
        self.lost: str | None = None
        self.broken = trio.Event()
        self.lanes: list[MemLane] = [MemLane(self) for _ in range(lanes)]
        self._keys = 0

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            self.broken.set()

    def check(self) -> None:
        if self.lost is not None:
            raise TransportError(self.peer, self.lost, lane_lost=True)

    async def open_lane(self) -> MemLane:
        lane = MemLane(self)
        self.lanes.append(lane)
        return lane

    async def create_pool(self, name: str, size: int) -> RemoteRegion:
        self.check()
        self.target.pools[name] = bytearray(size)
        return await self.open_pool(name)

    async def open_pool(self, name: str, epoch: tuple[int, int] | None = None, *,
                        holder: Mapping[str, Any] | None = None, takeover: bool = False) -> RemoteRegion:
        self.check()
        await self.target.answer(self, trio.current_time() + self.timeout)
        if name not in self.target.pools:
            raise TransportError(self.peer, f"no pool named {name!r}", code=2)
        if epoch is not None:
            owner = self.target.owner(name)
            why = refusal(owner, epoch[0], epoch[1], takeover)
            if why:
                raise TransportError(self.peer, f"pool {name!r}: {why}")
            self.target.owners[name] = Owner(epoch[1], dict(holder or {}), 0.0,
                                             owner.resync if owner else None)
        self._keys += 1
        return self.target._region(name, self._keys)

    async def probe_pool(self, name: str) -> dict[str, Any]:
        self.check()
        await self.target.answer(self, trio.current_time() + self.timeout)
        if name not in self.target.pools:
            raise TransportError(self.peer, f"no pool named {name!r}", code=2)
        pool = self.target.pools[name]
        hdr = find_header(pool)
        owner = self.target.owner(name)
        return {"ok": True, "name": name, "size": len(pool), "uuid": hdr.uuid.hex() if hdr else None,
                "owner": owner.as_dict() if owner else None, "writer": None}

    async def mark_resync(self, region: RemoteRegion, active: bool) -> None:
        self.check()
        await self.target.answer(self, trio.current_time() + self.timeout)
        owner = self.target.owner(region.name) or Owner(0)
        marker = {"since": 1.0, "by": "test"} if active else None
        self.target.owners[region.name] = replace(owner, resync=marker)
        self.target.ops.append(("resync", region.name, int(active), 0))

    async def grow_pool(self, name: str, size: int) -> None:
        self.check()
        pool = self.target.pools[name]
        pool.extend(bytes(size - len(pool)))

    async def close_pool(self, region: RemoteRegion) -> None:
        self.check()

    async def remove_pool(self, name: str) -> None:
        self.check()
        self.target.pools.pop(name, None)

    async def checksum(self, region: RemoteRegion, offset: int, length: int, chunk: int) -> list[int]:
        check_range(self.peer, region, offset, length)
        self.check()
        self.target.ops.append(("checksum", region.name, offset, length))
        await self.target.answer(self, trio.current_time() + self.timeout)
        pool = self.target.pools[region.name]
        return chunk_sums(memoryview(pool), offset, length, chunk)

    async def stats(self, name: str | None = None) -> dict[str, Any]:
        return {"flushes": self.target.flushes()}

    async def aclose(self) -> None:
        self.lose("session closed")
        if self in self.target.sessions:
            self.target.sessions.remove(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


@dataclass
class MemTransport:
    """Connects to the MemTargets it holds, by address."""

    targets: dict[str, MemTarget] = field(default_factory=dict)
    name: str = "mem"

    def add(self, target: MemTarget) -> MemTarget:
        self.targets[target.address] = target
        return target

    async def connect(self, address: str, token: bytes | None = None, *, lanes: int = 1,
                      timeout: float = DEFAULT_TIMEOUT) -> MemSession:
        target = self.targets.get(address)
        if target is not None:
            target.attempts.append(trio.current_time())
        if target is None or not target._up:
            raise TransportError(address, "connection refused", lane_lost=True)
        target.connects += 1
        session = MemSession(target, lanes, timeout)
        await target.answer(session, trio.current_time() + timeout)
        target.sessions.append(session)
        return session


    async def probe(self, address: str) -> bool:
        """Whether the target accepts connections now (ReplicaSet.probe): a hung target does,
        as a stopped process's listening socket still completes TCP handshakes."""
        target = self.targets.get(address)
        if target is None or not target._up:
            return False
        target.probes += 1
        return True


def _conforms(t: MemTransport, s: MemSession, lane: MemLane, ticket: MemTicket) -> tuple[
        Transport, Session, Lane, Ticket]:
    """For mypy: these are the Protocols' implementations."""
    return t, s, lane, ticket
