"""Control requests (JSON in SEND payloads): one handler per operation that
rpmemfs/transport/control_ops.py declares (create, open, probe, pools, evict, grow, resync,
close, remove, checksum, stats, info, rdma), each reading its request's fields by their
declared kinds (requests.py). Creates and grows are held to the token's quota (quota.py).

Not the hot path. A refused request gets a clean ``{"ok": false, "error": ...}`` reply and the
connection stays up: bad input in a request is not a framing violation.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from rpmemfs.chunksum import chunk_sums
from rpmemfs.pool.header import find_header
from rpmemfs.pool.layout import BLOCK, show_epoch
from rpmemfs.poolname import PoolNameError, check_name
from rpmemfs.target.authz import Grant, TokenBook
from rpmemfs.target.owners import Owner, OwnerBook, refusal
from rpmemfs.target.pools import PoolError, PoolStore
from rpmemfs.target.quota import Quotas
from rpmemfs.target.requests import Request
from rpmemfs.target.sessions import Region, SessionTable, TargetSession
from rpmemfs.transport.control_ops import ControlOp, find_op

if TYPE_CHECKING:
    from rpmemfs.target.verbs_server import VerbsService

log = logging.getLogger("rpmemfs.target.control")


# Checksum requests: chunk sizes and how many chunks one reply may carry.
MIN_CHUNK = 4096
MAX_CHUNK = 64 << 20
MAX_CHUNKS = 4096


Handler = Callable[[TargetSession, Request], Awaitable[dict[str, Any]]]


class ControlService:
    def __init__(self, store: PoolStore, sessions: SessionTable, method: str, info: dict[str, Any],
                 tokens: TokenBook | None = None) -> None:
        self._store = store
        self._tokens = tokens or TokenBook()
        self._quotas = Quotas(store)
        self._sessions = sessions
        self._method = method
        self.info = info
        self.verbs: VerbsService | None = None  # set when the target serves RDMA
        self.no_verbs = "this target does not serve RDMA"
        self._owners = OwnerBook(store.dir)
        # The one session that may write each pool (it claimed it under an epoch): a newer
        # claim takes its registration away, so an old primary's lanes stop landing writes.
        self._writers: dict[str, tuple[TargetSession, int]] = {}
        self.activity: dict[str, float] = {}  # pool name -> when its counters last moved
        # Every declared op's handler (tests/unit/test_control_ops.py checks that none is missing).
        self.handlers: dict[ControlOp, Handler] = {
            ControlOp.CREATE: self._create, ControlOp.OPEN: self._open, ControlOp.PROBE: self._probe,
            ControlOp.POOLS: self._pools, ControlOp.EVICT: self._evict, ControlOp.GROW: self._grow,
            ControlOp.RESYNC: self._resync, ControlOp.CLOSE: self._close, ControlOp.REMOVE: self._remove,
            ControlOp.CHECKSUM: self._checksum, ControlOp.STATS: self._stats, ControlOp.INFO: self._info,
            ControlOp.RDMA: self._rdma,
        }
        sessions.hooks.append(self)

    # SessionHook: a writer's registration or session went.
    def unregistered(self, session: TargetSession, key: int) -> None:
        for name, (s, k) in list(self._writers.items()):
            if s is session and k == key:
                del self._writers[name]

    def ended(self, session: TargetSession) -> None:
        for name, (s, _k) in list(self._writers.items()):
            if s is session:
                del self._writers[name]

    async def handle(self, session: TargetSession, request: object) -> dict[str, Any]:
        if not isinstance(request, dict):
            return {"ok": False, "error": "control request must be a JSON object", "code": "request"}
        op = request.get("op")
        if not isinstance(op, str):
            # A list or object here once reached the token check unhashable: an internal
            # error that cost the client its connection instead of this answer.
            return {"ok": False, "error": f"unknown control op {str(op)[:40]!r}", "code": "request"}
        try:
            session.grant.check(op, request)
            declared = find_op(op)
            if declared is not None:
                return await self.handlers[declared](session, Request(session, declared, request))
        except PoolNameError as exc:
            log.warning("peer %s: refused pool name: %s", session.peer, exc)
            return {"ok": False, "error": str(exc), "code": "bad-name"}
        except PoolError as exc:
            log.warning("peer %s: %s refused: %s", session.peer, op, exc)
            return {"ok": False, "error": str(exc), "code": exc.code}
        except OSError as exc:
            log.error("peer %s: %s failed: %s", session.peer, op, exc)
            return {"ok": False, "error": f"{op} failed on the target: {exc.strerror or exc}", "code": "io"}
        return {"ok": False, "error": f"unknown control op {str(op)[:40]!r}", "code": "request"}

    def _describe(self, region: Region) -> dict[str, Any]:
        uuid = region.pool.uuid
        return {
            "ok": True,
            "name": region.pool.name,
            "key": region.key,
            "size": region.size,
            "uuid": uuid.hex() if uuid else None,
            "method": self._method,
            "pmem": region.pool.mapping.kind,
            "writable": region.writable,
        }

    def _limits(self, session: TargetSession) -> Grant:
        """The session's grant as the token files say now: a quota lowered by a reload holds
        for sessions already open too."""
        return self._tokens.named(session.grant.name) or session.grant

    async def _create(self, session: TargetSession, request: Request) -> dict[str, Any]:
        name = request["name"]
        size = request["size"]
        with self._quotas.making(self._limits(session), name, size, grow=False):
            # fallocate of a large pool takes a while; the other connections are served meanwhile.
            await trio.to_thread.run_sync(self._store.create_file, name, size)
        try:
            return await self._open(session, request)
        except BaseException:
            # Made here and unusable (it cannot be registered, say): not left for a retry to trip on.
            with contextlib.suppress(PoolError, OSError):
                self._store.remove(name)
            raise

    def _owner(self, name: str, header_epoch: int | None) -> Owner | None:
        """The pool's recorded owner; for a pool without a record, the epoch in its header."""
        owner = self._owners.get(name)
        if owner is None and header_epoch is not None:
            owner = Owner(header_epoch)
        return owner

    def _ownership(self, name: str) -> dict[str, Any]:
        """What the target knows of pool ``name`` without mapping it: size, uuid, owner,
        writer. PoolNameError when there is no such pool."""
        size, head = self._store.head(check_name(name), 2 * BLOCK)
        hdr = find_header(memoryview(head))
        owner = self._owner(name, hdr.epoch if hdr else None)
        writer = self._writers.get(name)
        return {"size": size, "uuid": hdr.uuid.hex() if hdr else None,
                "owner": owner.as_dict() if owner else None, "writer": writer[0].peer if writer else None}

    async def _probe(self, session: TargetSession, request: Request) -> dict[str, Any]:
        """Who owns a pool, without opening it: what a mount asks every replica before it
        claims any (so that a refused mount changes no epoch anywhere)."""
        name = request["name"]
        return {"ok": True, "name": name, **self._ownership(name)}

    async def _pools(self, session: TargetSession, request: Request) -> dict[str, Any]:
        grants = self._tokens.grants() if session.grant.admin else [self._limits(session)]
        return {"ok": True, "pools": session.grant.visible(self.listing()),
                "quotas": self._quotas.report(grants)}

    async def _stats(self, session: TargetSession, request: Request) -> dict[str, Any]:
        return {"ok": True, "pools": session.grant.visible(self._counters(request["name"]))}

    async def _info(self, session: TargetSession, request: Request) -> dict[str, Any]:
        return {"ok": True, **self.info}

    async def _rdma(self, session: TargetSession, request: Request) -> dict[str, Any]:
        if self.verbs is None:
            raise PoolError(self.no_verbs, "no-rdma")
        return self.verbs.enable(session)

    def listing(self) -> dict[str, Any]:
        """Every pool in the directory: size, owner, writer, sessions, activity, counters."""
        out: dict[str, Any] = {}
        for name in self._store.names():
            try:
                entry = self._ownership(name)
            except (PoolNameError, OSError):
                continue  # not a pool: owner records, temporary files, anything else
            entry.pop("uuid")
            out[name] = {**entry, "sessions": self._sessions.holding(name),
                         "last_activity": self.activity.get(name), **self._store.stats(name)[name]}
        return out

    async def _evict(self, session: TargetSession, request: Request) -> dict[str, Any]:
        """Drop the registration of a pool's writing session (an administrator cleaning up
        after an initiator that is gone but whose connection the target has not seen die).
        Its owner record stays: the same initiator may claim it again."""
        name = request["name"]
        writer = self._writers.get(name)
        if writer is None:
            raise PoolError(f"pool {name!r} has no writing session", "request")
        peer = writer[0].peer
        log.warning("pool %s: writer %s evicted by %s", name, peer, session.peer)
        self._sessions.unregister(*writer)
        return {"ok": True, "evicted": peer}

    async def watch_activity(self, interval: float = 1.0) -> None:
        """When each open pool was last written, flushed or read (status wants it; the lanes'
        C loops only count, so the counts are sampled)."""
        seen: dict[str, tuple[int, ...]] = {}
        while True:
            for name, counters in self._store.stats().items():
                now = tuple(v for k, v in counters.items() if k != "open")
                if seen.get(name) != now:
                    if name in seen or any(now):  # (first seen with counts: active just now)
                        self.activity[name] = time.time()
                    seen[name] = now
            await trio.sleep(interval)

    def _counters(self, name: str | None) -> dict[str, Any]:
        pools = self._store.stats(name)
        for n, entry in pools.items():
            owner = self._owners.get(n)
            writer = self._writers.get(n)
            entry["owner"] = owner.as_dict() if owner else None
            entry["writer"] = writer[0].peer if writer else None
        return pools

    async def _open(self, session: TargetSession, request: Request) -> dict[str, Any]:
        name = request["name"]
        epoch = request["epoch"]
        takeover = request["takeover"] is True
        if takeover and epoch is None:
            raise PoolError("a takeover needs an epoch", "request")
        pool = self._store.open(name)
        owner: Owner | None = None
        if epoch is not None:
            owner = self._owner(name, pool.epoch)
            why = refusal(owner, epoch[0], epoch[1], takeover)
            if why:
                self._store.release(pool)
                raise PoolError(f"pool {name!r}: {why}", "epoch")
        if self._method == "apm" and not pool.mapping.is_pmem:
            self._store.release(pool)
            raise PoolError(
                f"pool {name!r} maps as {pool.mapping.kind!r}, which cannot honour the appliance "
                "method this target advertises",
                "method",
            )
        # Who does not claim a pool that someone claimed may read it, never write it.
        writable = epoch is not None or self._owners.get(name) is None
        try:
            region = session.register(pool, writable)
        except PoolError:
            self._store.release(pool)
            raise
        if epoch is not None:
            try:
                self._claimed(session, region, epoch[1], request["holder"], owner)
            except OSError:
                self._sessions.unregister(session, region.key)
                raise
        reply = self._describe(region)
        if request["rdma"]:
            if self.verbs is None:
                self._sessions.unregister(session, region.key)
                raise PoolError(self.no_verbs, "no-rdma")
            try:
                reply.update(self.verbs.register(session, region.key))
            except Exception as exc:
                self._sessions.unregister(session, region.key)
                why = f"pool {name!r}: cannot register it for RDMA: {exc}"
                if region.pool.mapping.kind == "dax" and "Errno: 95" in str(exc):
                    # Linux refuses long-term pins of file-system DAX pages (a truncate could
                    # pull them from under the NIC): only ODP-capable NICs or device DAX work.
                    why += (" (Linux refuses to pin file-system DAX memory for RDMA: put pools on "
                            "a device-DAX or non-DAX file system, use a NIC with on-demand paging, "
                            "or reach this target over tcp://; docs/verbs.md)")
                raise PoolError(why, "no-rdma") from None
        return reply

    async def _checksum(self, session: TargetSession, request: Request) -> dict[str, Any]:
        """CRC-32C of consecutive chunks of a registered pool, computed where the pool lives,
        so that comparing pools moves checksums over the wire instead of data."""
        region: Region = request["key"]
        offset: int = request["offset"]
        length: int = request["length"]
        chunk: int = request["chunk"]
        if not MIN_CHUNK <= chunk <= MAX_CHUNK or chunk % MIN_CHUNK:
            raise PoolError(f"checksum chunk must be a multiple of {MIN_CHUNK} up to {MAX_CHUNK}", "request")
        if offset + length > region.size:
            raise PoolError(
                f"checksum range ({offset}, {length}) is outside the pool of {region.size} bytes", "request"
            )
        if -(-length // chunk) > MAX_CHUNKS:
            raise PoolError(f"at most {MAX_CHUNKS} chunks per checksum request", "request")
        pool = region.pool
        pool.acquire()
        try:
            crcs = await trio.to_thread.run_sync(chunk_sums, pool.buf, offset, length, chunk)
        finally:
            pool.release()
        return {"ok": True, "crcs": crcs}

    async def _close(self, session: TargetSession, request: Request) -> dict[str, Any]:
        region: Region = request["key"]
        self._sessions.unregister(session, region.key)
        return {"ok": True}

    def _claimed(self, session: TargetSession, region: Region, epoch: int, holder: dict[str, Any],
                 owner: Owner | None) -> None:
        """Record a writer's claim (durably, before the answer) and fence the writer before it."""
        name = region.pool.name
        if owner is None or owner.epoch != epoch or (holder and owner.holder != holder):
            since = owner.since if owner is not None and owner.epoch == epoch else time.time()
            # A resync cut short stays marked across claims: the content is still mixed.
            self._owners.set(name, Owner(epoch, holder, since, owner.resync if owner else None))
            if owner is not None and owner.epoch != epoch:
                log.warning("pool %s: claimed at epoch %s by %s (was %s)", name, show_epoch(epoch),
                            holder.get("host", session.peer), show_epoch(owner.epoch))
        before = self._writers.get(name)
        if before is not None and before != (session, region.key):
            old_session, old_key = before
            log.warning("pool %s: the writer at %s is fenced: a claim at epoch %s took the pool",
                        name, old_session.peer, show_epoch(epoch))
            self._sessions.unregister(old_session, old_key)
        self._writers[name] = (session, region.key)

    async def _grow(self, session: TargetSession, request: Request) -> dict[str, Any]:
        """Grow a pool no session has open (`rpmemfs grow` grows the replicas before the
        primary). The initiator writes the bigger pool's header with its next barriers."""
        name = request["name"]
        size = request["size"]
        with self._quotas.making(self._limits(session), name, size, grow=True):
            grew = await trio.to_thread.run_sync(self._store.grow_file, name, size)
        return {"ok": True, "grown": grew}

    async def _resync(self, session: TargetSession, request: Request) -> dict[str, Any]:
        """Mark (``"active": true``, durably, before the first resync write lands) or clear the
        resync of a pool, for its writing session only: whoever copies this replica later must
        know whether it holds one point in time or parts of two (see owners.py)."""
        region: Region = request["key"]
        active: bool = request["active"]
        name = region.pool.name
        if self._writers.get(name) != (session, region.key):
            raise PoolError(f"pool {name!r}: only its writing session may mark a resync", "epoch")
        owner = self._owner(name, region.pool.epoch) or Owner(0)
        if active and owner.resync is None:
            by = owner.describe()
            self._owners.set(name, replace(owner, resync={"since": time.time(), "by": by}))
            log.info("pool %s: resync by %s began", name, by)
        elif not active and owner.resync is not None:
            self._owners.set(name, replace(owner, resync=None))
            log.info("pool %s: resync ended; the replica holds one point in time again", name)
        return {"ok": True}

    async def _remove(self, session: TargetSession, request: Request) -> dict[str, Any]:
        name = request["name"]
        self._store.remove(name)
        self._owners.forget(name)
        return {"ok": True}
