"""Sessions on the target: what one initiator registered, and the lanes that joined it.

A session lives as long as its control connection. When that closes, the session's lanes are
cancelled and its registrations dropped, so a vanished initiator leaves nothing mapped.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Protocol

import trio

from rpmemfs.target.authz import Grant
from rpmemfs.target.pools import Pool, PoolStore
from rpmemfs.target.regions import RegionTable
from rpmemfs.transport.wire import SESSION_ID_SIZE


@dataclass(frozen=True, slots=True)
class Region:
    key: int
    pool: Pool
    size: int
    slot: int
    # False for a session that opened a pool someone claimed without claiming it itself
    # (a reader: verify, recover, promote's copy): its writes are refused (fencing).
    writable: bool = True


@dataclass
class TargetSession:
    id: bytes
    peer: str
    grant: Grant  # what its token may do
    token: bytes = field(default=b"", repr=False)  # its lanes prove they hold the same one
    regions: dict[int, Region] = field(default_factory=dict)
    lanes: set[trio.CancelScope] = field(default_factory=set)
    table: RegionTable = field(default_factory=RegionTable)

    def register(self, pool: Pool, writable: bool = True) -> Region:
        # Keys are random so a key seen on one session says nothing about another's.
        while True:
            key = secrets.randbits(32)
            if key and key not in self.regions:
                break
        region = Region(key, pool, pool.size, self.table.publish(key, pool, writable), writable)
        self.regions[key] = region
        return region


class SessionHook(Protocol):
    """Something that keeps state per session (the verbs service: protection domains and
    memory regions), told before a registration or a session goes."""

    def unregistered(self, session: TargetSession, key: int) -> None: ...

    def ended(self, session: TargetSession) -> None: ...


class SessionTable:
    def __init__(self, store: PoolStore) -> None:
        self._store = store
        self._sessions: dict[bytes, TargetSession] = {}
        self.hooks: list[SessionHook] = []

    def __len__(self) -> int:
        return len(self._sessions)

    def new(self, peer: str, grant: Grant, token: bytes) -> TargetSession:
        while True:
            sid = secrets.token_bytes(SESSION_ID_SIZE)
            if sid not in self._sessions and any(sid):
                break
        session = TargetSession(sid, peer, grant, token)
        self._sessions[sid] = session
        return session

    def get(self, sid: bytes) -> TargetSession | None:
        return self._sessions.get(sid)

    def holding(self, name: str) -> list[str]:
        """The peers of the sessions that have pool ``name`` open."""
        return [s.peer for s in self._sessions.values()
                if any(r.pool.name == name for r in s.regions.values())]

    def unregister(self, session: TargetSession, key: int) -> Region | None:
        region = session.regions.pop(key, None)
        if region is None:
            return None
        for hook in self.hooks:  # remote access to the mapping ends before it may go
            hook.unregistered(session, key)
        if session.table.retire(region.slot):
            # A lane's C loop is inside a frame that writes into this pool; the mapping
            # must outlive that frame.
            trio.lowlevel.spawn_system_task(self._release_when_unused, session.table, region)
        else:
            self._store.release(region.pool)
        return region

    async def _release_when_unused(self, table: RegionTable, region: Region) -> None:
        while table.inflight(region.slot):
            await trio.sleep(0.001)
        self._store.release(region.pool)

    def end(self, session: TargetSession) -> None:
        self._sessions.pop(session.id, None)
        for hook in self.hooks:
            hook.ended(session)
        for scope in list(session.lanes):
            scope.cancel()
        for key in list(session.regions):
            self.unregister(session, key)
