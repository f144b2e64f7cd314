"""`rpmemfs replica add|remove MOUNTPOINT ADDRESS/NAME`: a mounted pool's replicas changed
while writers go on.

Add: the replica pool is created on its target if it is not there (the pool's header only:
the rest comes by comparison), or checked to be this pool's (same size and uuid, and no newer
owner: the old primary's pool file rejoining as a replica is such a copy); then it takes the
next slot of the replica table and of the sync map, marked to be compared in full, and the
set's keeper claims it at this mount's epoch, resyncs it (only chunks that differ move) and
lets it join. It counts toward min_replicas only once in sync, so adding never makes an fsync
fail; with the default policy (every replica), "every" includes it from then on. The table,
rewritten, is durable here before the command returns and reaches the replicas with the next
durability point.

Remove: refused when it would leave fewer replicas in sync than min_replicas (fsync would
return EIO) unless forced; the replica leaves the set with no barrier in flight to it, and the
table is rewritten. Its target keeps the pool and its owner record (a later `add` of it
compares it in full).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from rpmemfs.durability import Durability
from rpmemfs.durability.stale_table import StaleTable
from rpmemfs.mountd import control
from rpmemfs.pool.layout import AREAS_OFF, MAP_SLOTS
from rpmemfs.replica import ReplicaSet
from rpmemfs.replica.connect import check_probe
from rpmemfs.replica.fencing import probe_one
from rpmemfs.replica.replica import IN_SYNC, Replica
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import TableError, encode_table
from rpmemfs.transport.base import TransportError
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION

log = logging.getLogger("rpmemfs.mount")

GIVE_UP_AFTER = 30.0  # seconds a new replica may stay unusable before `add` returns (it stays)


@dataclass
class Membership:
    """What changing the replica set of a mounted pool touches."""

    pool: str
    specs: list[ReplicaSpec]  # the replica table's list (shared with the stale table)
    replicas: ReplicaSet
    durability: Durability
    table: StaleTable
    buf: memoryview
    uuid: bytes
    epochs: tuple[int, int]  # (before this mount, this mount's)
    token: bytes | None
    timeout: float
    token_file: str | None
    min_replicas: Callable[[int], None]  # tells the mount its policy's new value
    policy_all: bool  # min_replicas was not given: every replica (counted once in sync)
    wire_protection: str = DEFAULT_PROTECTION  # what connections to a new replica's target ask for

    async def request(self, args: list[str], send: control.Send, min_replicas: int) -> dict[str, Any]:
        """The control request `replica add|remove ADDRESS/NAME [force]`."""
        if len(args) < 2 or args[0] not in ("add", "remove") or not set(args[2:]) <= {"force"}:
            return {"error": "usage: replica add|remove ADDRESS/NAME [force]"}
        try:
            spec = ReplicaSpec.parse(args[1])
        except ValueError as e:
            return {"error": str(e)}
        if args[0] == "add":
            return await self.add(spec, send)
        return await self.remove(spec, "force" in args[2:], min_replicas)

    async def add(self, spec: ReplicaSpec, send: control.Send) -> dict[str, Any]:
        problem = self._addable(spec)
        if problem:
            return {"error": problem}
        probe = await probe_one(spec, self.token, self.timeout, wire_protection=self.wire_protection)
        if probe.error and "does not exist" in probe.error:
            try:
                with trio.fail_after(self.timeout):
                    # The header (with the uuid) is enough: the resync compares the rest.
                    await self.replicas.create_remote(spec, len(self.buf), self.buf, [(0, AREAS_OFF)],
                                                      token=self.token, timeout=self.timeout,
                                                      wire_protection=self.wire_protection)
            except (TransportError, trio.TooSlowError, ValueError) as exc:
                return {"error": f"replica {spec}: cannot create it on its target: {exc}"}
            created = True
        elif probe.error:
            return {"error": probe.error}
        else:
            why = check_probe(probe, len(self.buf), self.uuid, self.epochs)
            if why:
                return {"error": why}
            created = False
        self.specs.append(spec)
        replica = await self.replicas.add(spec)
        self.durability.persist_outside(self.table.rewrite(self.replicas.replicas))
        log.warning("replica %s added to %s (%s); it is compared and resynced now", spec, self.pool,
                    "created" if created else "an existing copy")
        return await self._until_in_sync(replica, send, created)

    def _addable(self, spec: ReplicaSpec) -> str | None:
        if str(spec) in {str(s) for s in self.specs}:
            return f"replica {spec} is in the set already"
        if len(self.specs) >= MAP_SLOTS:
            return f"the pool has {len(self.specs)} replicas, the most its sync map keeps ({MAP_SLOTS})"
        try:
            encode_table([*self.specs, spec], self.token_file)
        except TableError as exc:
            return f"replica {spec} does not fit the pool's replica table: {exc}"
        return None

    async def _until_in_sync(self, replica: Replica, send: control.Send, created: bool) -> dict[str, Any]:
        """Progress lines while it resyncs; the answer when it is in sync, or has stayed
        unusable for GIVE_UP_AFTER seconds (it stays in the set, retried)."""
        failing_since: float | None = None
        while replica.state is not IN_SYNC:
            p = replica.resync
            if isinstance(p, dict) and p.get("total"):
                await send({"progress": int(p.get("done", 0)), "total": int(p["total"])})
            if replica.last_error and replica.state.value == "stale":
                failing_since = failing_since or trio.current_time()
                if trio.current_time() - failing_since > GIVE_UP_AFTER:
                    return {"error": f"replica {replica.spec} was added but is not usable yet: "
                                     f"{replica.last_error}; it stays in the set and is retried "
                                     "(`rpmemfs status` shows it; `rpmemfs replica remove` takes it out)"}
            else:
                failing_since = None
            await trio.sleep(0.2)
        if self.policy_all:
            self.min_replicas(len(self.specs))  # from now on "all" includes it
        return {"added": str(replica.spec), "created": created, "slot": replica.slot,
                "resync": replica.last_resync}

    async def remove(self, spec: ReplicaSpec, force: bool, min_replicas: int) -> dict[str, Any]:
        found = [r for r in self.replicas.replicas if str(r.spec) == str(spec)]
        if not found:
            listed = ", ".join(map(str, self.specs)) or "none"
            return {"error": f"replica {spec} is not in the set ({listed})"}
        replica = found[0]
        left = [r for r in self.replicas.in_sync if r is not replica]
        if self.policy_all:
            min_replicas = len(self.specs) - 1  # "all" of what is left
        if len(left) < min_replicas and not force:
            return {"error": f"removing {spec} leaves {len(left)} replicas in sync, fewer than "
                             f"min_replicas={min_replicas}: fsync would return EIO; --force removes "
                             "it anyway (and lowers min_replicas to the replicas left)"}
        await self.replicas.remove(replica)
        self.specs[:] = [s for s in self.specs if str(s) != str(spec)]
        self.min_replicas(len(self.specs) if self.policy_all else min(min_replicas, len(self.specs)))
        self.durability.persist_outside(self.table.rewrite(self.replicas.replicas))
        log.warning("replica %s removed from %s", spec, self.pool)
        return {"removed": str(spec), "replicas": [str(s) for s in self.specs]}
