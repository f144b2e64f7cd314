"""Control requests (JSON in SEND payloads): create, open, close, remove, checksum, stats, info.

Not the hot path. A refused request gets a clean ``{"ok": false, "error": ...}`` reply and the
connection stays up: bad input in a request is not a framing violation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from rpmemfs.native import crc32c
from rpmemfs.pool.layout import epoch_gen, show_epoch
from rpmemfs.target.names import PoolNameError, check_name
from rpmemfs.target.pools import PoolError, PoolStore
from rpmemfs.target.sessions import Region, SessionTable, TargetSession

if TYPE_CHECKING:
    from rpmemfs.target.verbs_server import VerbsService

log = logging.getLogger("rpmemfs.target.control")


# Checksum requests: chunk sizes and how many chunks one reply may carry.
MIN_CHUNK = 4096
MAX_CHUNK = 64 << 20
MAX_CHUNKS = 4096


def _epoch_pair(value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and 0 <= v < 1 << 64 for v in value)):
        raise PoolError("epoch must be [previous, current], two unsigned 64-bit integers", "request")
    return value[0], value[1]


def fence(pool_epoch: int | None, prev: int, cur: int) -> str | None:
    """Why an initiator at ``cur`` (``prev`` before its mount) must not write this pool, or None.

    The pool is fine when it is where this initiator left it (``prev``), already at ``cur``
    (a reconnect within the same mount), or behind (an older generation: a stale replica,
    which resync brings up to date). Anything else was mounted elsewhere since: a failover
    made it a primary of its own, and writing over it would lose what it took.
    """
    if pool_epoch is None or pool_epoch in (prev, cur) or epoch_gen(pool_epoch) < epoch_gen(prev):
        return None
    return (f"the pool is at epoch {show_epoch(pool_epoch)}, but this initiator was at epoch "
            f"{show_epoch(prev)} and is now at {show_epoch(cur)}: the pool was mounted elsewhere "
            f"since (a failover?) and moved on; refusing to write over it")


def _crcs(buf: memoryview, offset: int, length: int, chunk: int) -> list[int]:
    return [
        crc32c(buf[pos : min(pos + chunk, offset + length)]) for pos in range(offset, offset + length, chunk)
    ]


class ControlService:
    def __init__(self, store: PoolStore, sessions: SessionTable, method: str, info: dict[str, Any]) -> None:
        self._store = store
        self._sessions = sessions
        self._method = method
        self.info = info
        self.verbs: VerbsService | None = None  # set when the target serves RDMA
        self.no_verbs = "this target does not serve RDMA"

    async def handle(self, session: TargetSession, request: object) -> dict[str, Any]:
        if not isinstance(request, dict):
            return {"ok": False, "error": "control request must be a JSON object", "code": "request"}
        op = request.get("op")
        try:
            if op == "create":
                return await self._create(session, request)
            if op == "open":
                return self._open(session, request)
            if op == "close":
                return self._close(session, request)
            if op == "remove":
                return self._remove(session, request)
            if op == "checksum":
                return await self._checksum(session, request)
            if op == "stats":
                name = request.get("name")
                return {"ok": True, "pools": self._store.stats(None if name is None else check_name(name))}
            if op == "info":
                return {"ok": True, **self.info}
            if op == "rdma":
                if self.verbs is None:
                    raise PoolError(self.no_verbs, "no-rdma")
                return self.verbs.enable(session)
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
        }

    async def _create(self, session: TargetSession, request: dict[str, Any]) -> dict[str, Any]:
        name = check_name(request.get("name"))
        # fallocate of a large pool takes a while; the other connections are served meanwhile.
        await trio.to_thread.run_sync(self._store.create_file, name, request.get("size"))
        return self._open(session, request)

    def _open(self, session: TargetSession, request: dict[str, Any]) -> dict[str, Any]:
        name = check_name(request.get("name"))
        epoch = _epoch_pair(request.get("epoch"))
        pool = self._store.open(name)
        if epoch is not None:
            refusal = fence(pool.epoch, *epoch)
            if refusal:
                self._store.release(pool)
                raise PoolError(f"pool {name!r}: {refusal}", "epoch")
        if self._method == "apm" and not pool.mapping.is_pmem:
            self._store.release(pool)
            raise PoolError(
                f"pool {name!r} maps as {pool.mapping.kind!r}, which cannot honour the appliance "
                "method this target advertises",
                "method",
            )
        try:
            region = session.register(pool)
        except PoolError:
            self._store.release(pool)
            raise
        reply = self._describe(region)
        if request.get("rdma"):
            if self.verbs is None:
                self._sessions.unregister(session, region.key)
                raise PoolError(self.no_verbs, "no-rdma")
            try:
                reply.update(self.verbs.register(session, region.key))
            except Exception as exc:
                self._sessions.unregister(session, region.key)
                raise PoolError(f"pool {name!r}: cannot register it for RDMA: {exc}", "no-rdma") from None
        return reply

    async def _checksum(self, session: TargetSession, request: dict[str, Any]) -> dict[str, Any]:
        """CRC-32C of consecutive chunks of a registered pool, computed where the pool lives,
        so that comparing pools moves checksums over the wire instead of data."""
        key, offset, length, chunk = (request.get(k) for k in ("key", "offset", "length", "chunk"))
        region = session.regions.get(key) if isinstance(key, int) else None
        if region is None:
            raise PoolError(f"no pool is registered with key {key!r} in this session", "bad-key")
        for name, value in (("offset", offset), ("length", length), ("chunk", chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PoolError(f"checksum {name} must be a non-negative integer", "request")
        assert isinstance(offset, int) and isinstance(length, int) and isinstance(chunk, int)
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
            crcs = await trio.to_thread.run_sync(_crcs, pool.buf, offset, length, chunk)
        finally:
            pool.release()
        return {"ok": True, "crcs": crcs}

    def _close(self, session: TargetSession, request: dict[str, Any]) -> dict[str, Any]:
        key = request.get("key")
        if not isinstance(key, int) or self._sessions.unregister(session, key) is None:
            raise PoolError(f"no pool is registered with key {key!r} in this session", "bad-key")
        return {"ok": True}

    def _remove(self, session: TargetSession, request: dict[str, Any]) -> dict[str, Any]:
        self._store.remove(check_name(request.get("name")))
        return {"ok": True}
