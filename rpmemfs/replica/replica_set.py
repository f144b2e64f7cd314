"""The replica set: the one class callers use for the replicas of a local pool.

`ReplicaSet` is `Barriers` (barriers.py: post, complete, barrier, drain, the hot path of every
fsync) plus the rest of a replica set's life, each job in a module of its own:

- connect.py: open a checked session with each replica and bring it in sync (`open`), and
  again with backoff whenever one falls behind (`keep`);
- resync.py: send a replica what it missed, then let it join the barriers;
- live_verify.py: verify and repair of the mounted pool (`verify`, `repair`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from rpmemfs.native import ffi
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.replica.barriers import Barriers, InFlight, ReplicaError
from rpmemfs.replica.connect import Connect, ReplicaUnusable, bring_up, open_session, show_uuid
from rpmemfs.replica.errors import ReplicationError
from rpmemfs.replica.live_verify import VERIFY_ROUNDS, repair_live, verify_live
from rpmemfs.replica.remote import create_remote
from rpmemfs.replica.replica import IN_SYNC, Replica
from rpmemfs.replica.resync import COPY_BATCH, LAST_PASS_BYTES, MAX_PASSES
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.verify import ReplicaReport
from rpmemfs.transport.base import DEFAULT_TIMEOUT, RemoteRegion, Session, Transport
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.probe import accepts_connections
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION

# What callers imported from here before the set was split by job.
__all__ = [
    "COPY_BATCH",
    "DEFAULT_RECONNECT",
    "LAST_PASS_BYTES",
    "MAX_PASSES",
    "MAX_RECONNECT",
    "PROBE_INTERVAL",
    "VERIFY_ROUNDS",
    "InFlight",
    "ReplicaError",
    "ReplicaSet",
    "ReplicaUnusable",
    "show_uuid",
]

log = logging.getLogger(__name__)

DEFAULT_RECONNECT = 1.0  # seconds before a replica that fell behind is tried again...
MAX_RECONNECT = 5.0  # ...doubling up to this: with the default policy fsync fails meanwhile
# Between attempts the target's port is probed (a TCP connect, closed at once), so that a
# target that comes back is tried within a probe interval, not at the end of the backoff.
PROBE_INTERVAL = 0.25
PROBE_TIMEOUT = 1.0  # a cut link drops the SYN: no answer at all

# Whether the target at an address accepts connections now.
Probe = Callable[[str], Awaitable[bool]]


async def _probe_tcp(address: str) -> bool:
    return await accepts_connections(address, PROBE_TIMEOUT)


class ReplicaSet(Barriers):
    """The replicas of one local pool: the barrier that serves them all, and their repair."""

    def __init__(self, replicas: list[Replica], local_buf: memoryview, *,
                 min_replicas: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                 syncmap: SyncMap | None = None, lock: trio.Lock | None = None) -> None:
        super().__init__(replicas, local_buf, min_replicas=min_replicas, timeout=timeout,
                         syncmap=syncmap, lock=lock)
        self.reconnect_interval = DEFAULT_RECONNECT
        self.max_reconnect = MAX_RECONNECT
        # Every transport reaches its target's TCP port first: one probe serves them all.
        self.probe: Probe = _probe_tcp
        self._connect: Connect | None = None
        # Bytes compared or copied by resyncs, for a progress bar.
        self.progress: Callable[[int], None] = lambda n: None
        # Where keep() runs each replica's keeper, so that a replica added later gets one.
        self._keepers: trio.Nursery | None = None
        self._keeper_scopes: dict[int, trio.CancelScope] = {}  # id(replica) -> its keeper's scope
        self._on_change: Callable[[], None] = lambda: None
        self.token: bytes | None = None  # what connections to the targets prove (set by open)

    create_remote = staticmethod(create_remote)

    @classmethod
    async def open(
        cls,
        specs: list[ReplicaSpec],
        local_buf: memoryview,
        uuid: bytes,
        token: bytes | None,
        lanes: int = 2,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        min_replicas: int | None = None,
        transport: Transport | None = None,
        wire_protection: str = DEFAULT_PROTECTION,
        syncmap: SyncMap | None = None,
        lock: trio.Lock | None = None,
        epoch: tuple[int, int] | None = None,
        slots: list[int] | None = None,
        progress: Callable[[int], None] | None = None,
        holder: Mapping[str, Any] | None = None,
        takeover: bool = False,
        unreachable: Mapping[str, str] | None = None,
    ) -> ReplicaSet:
        """Connect to every replica in parallel, check each against the local pool, and bring
        those that miss something up to date (from the sync map, or by comparing checksums).

        A replica that cannot be reached, or whose pool is not this pool's replica, is left
        "stale" with the reason in ``last_error``; nothing is raised, so the caller decides
        by its policy (``min_replicas``) whether to go on, and :meth:`keep` retries it.
        ``unreachable`` ("ADDR/NAME": why) are replicas that just did not answer the caller:
        they start stale, without a second wait on an address that answers nothing (a dead
        node's costs a whole ``timeout``), and :meth:`keep` tries them as it tries any.
        """
        if lanes < 1:
            raise ValueError(f"lanes={lanes}: a replica needs at least one lane")
        slots = slots if slots is not None else list(range(len(specs)))
        replicas = [Replica(spec, slot) for spec, slot in zip(specs, slots, strict=True)]
        self = cls(replicas, local_buf, min_replicas=min_replicas, timeout=timeout,
                   syncmap=syncmap, lock=lock)
        if progress is not None:
            self.progress = progress

        # A takeover claims past a newer owner once, when the set opens; reconnects later
        # claim as usual (the replicas then hold this set's own epoch).
        opening = [takeover]

        self.token = token

        async def connect(replica: Replica) -> tuple[Session, RemoteRegion]:
            tp = transport or transport_for(replica.spec.transport, wire_protection=wire_protection)
            # self.token, not token: the mount rereads its token file on SIGHUP.
            return await open_session(replica, tp, len(local_buf), uuid, self.token, lanes, epoch,
                                      self.timeout, holder, opening[0])

        self._connect = connect
        async with trio.open_nursery() as nursery:
            for replica in replicas:
                if unreachable and (why := unreachable.get(str(replica.spec))):
                    replica.fail(why)
                    replica.note(why)
                    continue
                nursery.start_soon(self._bring_up, replica)
        opening[0] = False
        return self

    async def _bring_up(self, replica: Replica) -> bool:
        assert self._connect is not None
        return await bring_up(self, replica, self._connect, self.progress)

    async def keep(self, on_change: Callable[[], None] = lambda: None) -> None:
        """Reconnect replicas that fell behind, for as long as the mount lives; ``on_change``
        is called whenever one falls behind or is back in sync (the mount records which
        replicas are stale in the pool)."""
        self._on_change = on_change
        async with trio.open_nursery() as nursery:
            self._keepers = nursery
            for replica in self.replicas:
                self._start_keeper(replica)
            await trio.sleep_forever()

    def _start_keeper(self, replica: Replica) -> None:
        assert self._keepers is not None
        scope = trio.CancelScope()
        self._keeper_scopes[id(replica)] = scope

        async def run() -> None:
            with scope:
                await self._keeper(replica, self._on_change)

        self._keepers.start_soon(run)

    # ---------------------------------------------------------------- membership

    async def add(self, spec: ReplicaSpec) -> Replica:
        """A new replica, in the next slot, stale and compared in full: its keeper (keep()
        must be running) claims it, resyncs it and lets it join. Barriers are not held up:
        it joins as every resync does, under the barrier lock at its last pass."""
        if self._keepers is None:
            raise ReplicationError("replicas can be added only while the set keeps its replicas")
        async with self.lock:
            replica = Replica(spec, len(self.replicas))
            if self.syncmap is not None:
                self.syncmap.set_full(replica.slot)
            self.replicas.append(replica)
            self._start_keeper(replica)
        return replica

    async def remove(self, replica: Replica) -> None:
        """Take ``replica`` out: no barrier is in flight to it when this returns; its keeper
        is stopped and its session closed; the replicas after it move down a slot (their
        sync map bits with them), so slots stay the replica table's order."""
        async with self.lock:
            await self.drain()
            index = self.replicas.index(replica)
            del self.replicas[index]
            if len(self.replicas) < self.min_replicas:
                self.min_replicas = len(self.replicas)
            self._stop_keeper(replica)
            # A replica that moves while it resyncs would go on with its old slot: its resync
            # is stopped, and it starts again, compared in full, from its new slot.
            restart = [r for r in self.replicas[index:] if r.state is not IN_SYNC]
            for r in restart:
                self._stop_keeper(r)
            for r in self.replicas[index:]:
                if self.syncmap is not None:
                    self.syncmap.move(r.slot, r.slot - 1)
                r.slot -= 1
            if self.syncmap is not None:
                self.syncmap.settle(len(self.replicas))  # the freed last slot, empty
            for r in restart:
                r.fail(f"moved to slot {r.slot} while another replica was removed")
                if self.syncmap is not None:
                    self.syncmap.set_full(r.slot)
        await replica.aclose(self.timeout)
        for r in restart:
            await r.aclose(self.timeout)
            if self._keepers is not None:  # (else nobody keeps replicas: nothing to restart)
                self._start_keeper(r)

    def _stop_keeper(self, replica: Replica) -> None:
        scope = self._keeper_scopes.pop(id(replica), None)
        if scope is not None:
            scope.cancel()

    async def _keeper(self, replica: Replica, on_change: Callable[[], None]) -> None:
        backoff = self.reconnect_interval
        told = ""  # why it is unusable, as last logged: a line when that changes, not per attempt
        while True:
            if replica.state is IN_SYNC:
                await replica.fell_behind.wait()
                log.warning("replica %s fell behind: %s", replica.spec, replica.last_error)
                self.on_fell_behind(replica)
                on_change()
                await replica.aclose(self.timeout)
                backoff = self.reconnect_interval
                continue
            await self._until_retry(replica, backoff)
            log.debug("replica %s: reconnecting", replica.spec)
            cleared, since = replica.last_error, replica.last_error_at
            if await self._bring_up(replica):
                if cleared:
                    log.warning("replica %s is in sync again (its last error, at %s: %s)",
                                replica.spec, since, cleared)
                else:  # a replica just added, say: it was never out of sync with an error
                    log.info("replica %s is in sync", replica.spec)
                told = ""
                on_change()
            else:
                why = replica.last_error or ""
                if why != told and replica.taken_over:
                    # What an administrator must act on (docs/failover.md), at the default level.
                    log.error("fenced: %s", why)
                elif why != told:
                    log.info("replica %s still unusable: %s", replica.spec, why)
                told = why
                backoff = min(backoff * 2, self.max_reconnect)

    async def _until_retry(self, replica: Replica, delay: float) -> None:
        """Wait ``delay`` seconds, or less: until the replica's target, found not accepting
        connections, accepts them again (restarted, or its link is back)."""
        with trio.move_on_after(delay):
            down = False
            while True:
                if await self.probe(replica.spec.address):
                    if down:
                        log.info("replica %s: its target accepts connections again", replica.spec)
                        return
                    # It accepts, so the last attempt failed further on (refused, not this
                    # pool's replica, hung): only a full attempt tells when that changes.
                    await trio.sleep_forever()
                down = True
                await trio.sleep(PROBE_INTERVAL)

    async def verify(self, chunk: int, durable: Callable[[], Awaitable[None]],
                     progress: Callable[[int], None] = lambda n: None) -> list[ReplicaReport]:
        """Compare the live pool with every replica by chunk checksums (live_verify.py)."""
        return await verify_live(self, chunk, durable, progress)

    async def repair(self, replica: Replica, progress: Callable[[int], None] | None = None
                     ) -> dict[str, Any]:
        """Verify-and-repair of an in-sync replica while the mount serves (rpmemfs sync)."""
        return await repair_live(self, replica, progress or self.progress, self.progress)

    def status(self) -> list[dict[str, Any]]:
        return [{**r.status(), "lag_bytes": self.lag(r)} for r in self.replicas]

    def taken_over(self) -> str | None:
        """Which replicas another primary holds since this mount claimed them (a failover
        fenced this mount from them), and who holds each; None when none."""
        held = [f"replica {r.spec} is held by {r.taken_over}" for r in self.replicas if r.taken_over]
        return "; ".join(held) or None

    def lag(self, replica: Replica) -> int | None:
        """Bytes the replica misses (0 in sync), as the sync map counts them (whole chunks);
        None when nothing is known but that it must be compared in full."""
        if replica.state is IN_SYNC:
            return 0
        sm = self.syncmap
        if sm is None or not sm.enabled or sm.full(replica.slot):
            return None
        return sm.count(replica.slot) * sm.chunk

    async def aclose(self) -> None:
        async with trio.open_nursery() as nursery:
            for replica in self.replicas:
                nursery.start_soon(replica.aclose, self.timeout)
        ffi.release(self._local.base)
