"""The one interface every transport implements (TCP: tcp.py; verbs: verbs.py), and what it
trades in.

The model is RDMA's reliable connection: a session with a target holds registered regions
(remote pools, each named by a 32-bit key) and several lanes. A lane is one ordered stream,
like a queue pair: writes are one-sided and unsignaled, and a flush on the same lane (an
8-byte read for the appliance method, one send with the whole range list for the
general-purpose method) completes only after every earlier write on that lane is placed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from types import TracebackType
from typing import Any, Literal, Protocol, Self

from rpmemfs.errors import RpmemfsError
from rpmemfs.native import ffi

BytesLike = bytes | bytearray | memoryview
# What a target declares (METHODS), plus "flush": a verbs-only barrier whose flush is a native
# RDMA FLUSH (global visibility, ordered after the writes: apm's guarantee, without the READ),
# which a verbs session picks for an appliance target where both ends have it.
Method = Literal["apm", "gpspm", "flush"]
METHODS: tuple[Method, ...] = ("apm", "gpspm")
# What a barrier's flush is, as status and metrics name it: a native RDMA FLUSH of the
# persistent type (the data is in the target's persistence domain when it completes) or of the
# global-visibility type, the appliance method's 8-byte READ, or the general-purpose SEND.
Flush = Literal["persistent", "visibility", "read", "send"]
FLUSHES: tuple[Flush, ...] = ("persistent", "visibility", "read", "send")
DEFAULT_TIMEOUT = 10.0


class TransportError(RpmemfsError):
    """An operation with a target failed; ``peer`` and ``reason`` say where and why.

    ``lane_lost`` is True when the connection it happened on is gone (the target closed it
    after a violation, the peer vanished, or a deadline passed mid-operation); otherwise the
    error was a clean reply and the session and lane go on working. ``timed_out``: the peer
    answered nothing within the deadline (a dead node's address does that; a refusal does not).
    """

    def __init__(self, peer: str, reason: str, *, code: int | None = None, lane_lost: bool = False,
                 timed_out: bool = False) -> None:
        super().__init__(f"{peer}: {reason}" if peer else reason)
        self.peer = peer
        self.reason = reason
        self.code = code
        self.lane_lost = lane_lost
        self.timed_out = timed_out


@dataclass(frozen=True)
class RemoteRegion:
    """A pool on a target, registered for one session."""

    name: str
    key: int
    size: int
    uuid: bytes | None  # from the pool header; None while the pool holds no valid header yet
    method: Method  # how the target makes placed writes durable: the flush to use
    pmem: str  # the target's mapping kind: "dax", "force" or "msync"
    # Verbs only: the pool's memory region on the target (its rkey and virtual address).
    rkey: int = 0
    raddr: int = 0
    # Method "flush" only: the type of native FLUSH its barriers post (else: the method's).
    native: Flush = "visibility"

    @property
    def flush(self) -> Flush:
        """What a barrier of this region's method ends with."""
        return flush_of(self.method, self.native)


def declared(method: Method | None) -> Method | None:
    """The persistence method the target declared for a region whose barriers use ``method``:
    a native FLUSH is only ever chosen for an appliance target."""
    return "apm" if method == "flush" else method


def flush_of(method: Method, native: Flush = "visibility") -> Flush:
    """The flush a barrier of ``method`` ends with (``native``: the FLUSH type, for "flush")."""
    return native if method == "flush" else "read" if method == "apm" else "send"


@dataclass
class LaneStats:
    """What an initiator sent on a lane; the target keeps its own counters per pool."""

    writes: int = 0
    bytes: int = 0
    flushes: int = 0
    reads: int = 0
    atomics: int = 0
    sends: int = 0
    batches: int = 0  # operations handed to the kernel, each as one vectored send
    sendmsgs: int = 0  # sendmsg calls: more than batches only when the socket buffer filled


@dataclass(frozen=True)
class LocalPool:
    """The local pool as a transport sees it: its bytes, and where they start for C code
    (a cffi pointer, or None where there is none)."""

    buf: memoryview
    base: Any


def packed_offsets(data: BytesLike, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Where each range's bytes start in ``data``, which holds them back to back; ValueError
    unless they fill it exactly."""
    starts = [0, *accumulate(length for _, length in ranges)]
    if starts[-1] != len(data):
        raise ValueError(f"{len(ranges)} ranges of {starts[-1]} bytes in all, but {len(data)} bytes of data")
    return starts[:-1]


def unpack(data: BytesLike, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, memoryview]]:
    """Packed ranges (their bytes back to back in ``data``) as (offset, bytes) writes."""
    view = memoryview(data)
    return [(off, view[s : s + k]) for (off, k), s in zip(ranges, packed_offsets(data, ranges), strict=True)]


class RangeList(list[tuple[int, int]]):
    """(offset, length) ranges one barrier sends to every replica: C code reads them as a
    uint64_t array of pairs, built once for all lanes (:meth:`pairs`). Not to be changed
    once a lane has asked for its pairs."""

    __slots__ = ("_pairs",)

    def pairs(self) -> Any:
        try:
            return self._pairs
        except AttributeError:
            self._pairs: Any = _pairs(self)
            return self._pairs


def _pairs(ranges: Sequence[tuple[int, int]]) -> Any:
    return ffi.new("uint64_t[]", [x for r in ranges for x in r])


def pairs_of(ranges: Sequence[tuple[int, int]]) -> Any:
    """The ranges as C reads them: shared when they are a RangeList, else made now."""
    return ranges.pairs() if isinstance(ranges, RangeList) else _pairs(ranges)


@dataclass(frozen=True, slots=True)
class LocalRanges:
    """Writes of ``ranges`` of the local pool, each to the same offset of the remote pool: what
    replication posts, without a buffer object per range (TCP builds the frames in C)."""

    pool: LocalPool
    ranges: Sequence[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class PackedRanges:
    """Writes of ``ranges`` (offset, length) of the remote pool whose bytes lie back to back in
    ``data``: copies taken earlier (asynchronous replication)."""

    data: BytesLike
    ranges: Sequence[tuple[int, int]]


# What one barrier writes: (offset, bytes) pairs, ranges of the local pool, or packed copies.
Writes = Sequence[tuple[int, BytesLike]] | LocalRanges | PackedRanges


class Ticket(Protocol):
    """A barrier posted without waiting; only the lane that posted it can poll or wait for it
    (its ``poll`` and ``wait``)."""


class Lane(Protocol):
    """One ordered stream to a target: a barrier is one post and one wait (or polls), like
    ibv_post_send and the one completion a caller then reaps; reads, atomic writes and control
    messages beside them."""

    @property
    def peer(self) -> str: ...

    @property
    def stats(self) -> LaneStats: ...

    @property
    def closed(self) -> bool: ...

    def post(self, region: RemoteRegion, writes: Writes, method: Method | None = None) -> Ticket:
        """Post the writes and exactly one flush (``method``, else the region's) without
        waiting (what remains to send, if the socket buffer was full, goes out in
        :meth:`wait`). The caller then polls or waits for the one completion."""

    def poll(self, ticket: Ticket) -> bool:
        """True once the barrier completed; never waits. TransportError if it failed."""

    async def wait(self, ticket: Ticket) -> None:
        """Wait for the barrier's completion (bounded by the session timeout)."""

    async def read(self, region: RemoteRegion, offset: int, length: int) -> bytes: ...

    async def atomic_write(self, region: RemoteRegion, offset: int, value: int) -> None:
        """Store a u64 at an 8-byte aligned offset, ordered like a write (one-sided)."""

    async def send(self, msg: bytes) -> None:
        """Send a small control message; its reply is what :meth:`recv` returns next."""

    async def recv(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Session(Protocol):
    # Read-only properties, so an implementation may hold narrower types (list[TcpLane]).
    @property
    def peer(self) -> str: ...

    @property
    def info(self) -> Mapping[str, Any]:
        """What the target said about itself at connect time (method, pmem kind, limits)."""

    @property
    def lanes(self) -> Sequence[Lane]: ...

    async def open_lane(self) -> Lane: ...

    async def create_pool(self, name: str, size: int) -> RemoteRegion:
        """Create a zero-filled pool of ``size`` bytes on the target and register it."""

    async def open_pool(self, name: str, epoch: tuple[int, int] | None = None, *,
                        holder: Mapping[str, Any] | None = None, takeover: bool = False) -> RemoteRegion:
        """Register an existing pool. With ``epoch`` = (the initiator's epoch before this mount,
        its epoch now) the initiator claims the pool as its writer: the target refuses a pool
        another initiator claimed since (a failover), naming it, and otherwise records the
        claim (with ``holder``: who is claiming, for the target to name to others) and fences
        the writer before. ``takeover``: claim with an epoch above any recorded one."""

    async def probe_pool(self, name: str) -> dict[str, Any]:
        """Who owns a pool (its recorded epoch and holder) and whether a writer has it open,
        without opening it."""

    async def mark_resync(self, region: RemoteRegion, active: bool) -> None:
        """Record on the target (durably, before answering) that a resync of this claimed pool
        begins, or that it ended: a replica between the two holds parts of two points in time,
        and whoever would copy it (promote, recover) must be told."""

    async def grow_pool(self, name: str, size: int) -> None:
        """Grow a pool no session has open to ``size`` bytes (a no-op at that size already)."""

    async def close_pool(self, region: RemoteRegion) -> None: ...

    async def remove_pool(self, name: str) -> None: ...

    async def checksum(self, region: RemoteRegion, offset: int, length: int, chunk: int) -> list[int]:
        """CRC-32C of each ``chunk`` of [offset, offset + length), computed by the target."""

    async def stats(self, name: str | None = None) -> dict[str, Any]:
        """The target's counters per pool (writes, bytes, flushes, ...)."""

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Transport(Protocol):
    name: str

    async def connect(
        self, address: str, token: bytes | None = None, *, lanes: int = 1, timeout: float = DEFAULT_TIMEOUT
    ) -> Session: ...


async def barrier(lane: Lane, region: RemoteRegion, writes: Writes, method: Method | None = None) -> None:
    """Make ``writes`` durable on the target: one batch of writes and exactly one flush."""
    await lane.wait(lane.post(region, writes, method))


def nbytes(data: BytesLike) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


def check_range(peer: str, region: RemoteRegion, offset: int, length: int) -> None:
    """Refuse locally what the target would refuse by closing the lane."""
    if offset < 0 or length < 0 or offset + length > region.size:
        raise TransportError(
            peer, f"range ({offset}, {length}) is outside pool {region.name!r} of {region.size} bytes"
        )
