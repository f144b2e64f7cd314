"""Fencing, from the initiator's side: who owns each replica, asked before anything is claimed.

Every replica pool's target records the epoch of the initiator that last claimed it (see
rpmemfs/target/owners.py). A mount claims its replicas under a new epoch, but first it asks
every replica who owns it (``probe_replicas``), so that:

- a mount of a pool that was taken over (a failover promoted another copy, whose claim the
  replicas recorded) is refused before it changes any epoch, here or on a replica, however
  often it is retried;
- the epoch in the local pool only moves when this mount is going to claim replicas with it,
  so a pool mounted alone never outgrows the epoch of the primary that replaced it.

An epoch is a generation (high 32 bits) and a random nonce: ``Probe.newer_than`` is the test
the target applies to a normal claim, seen from this side. ``ask_owners`` is what a mount asks
before it claims: every replica probed, the epoch to claim under chosen (a ``Claim``), and
the replicas another primary holds named; what to do then (refuse, or mount alone) is the
mount's policy (mountd/assemble.py).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from rpmemfs.pool.layout import epoch_gen, next_epoch, show_epoch
from rpmemfs.printable import printable
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import Transport, TransportError
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION


@dataclass
class Probe:
    """What one replica's target said about its pool, or why it could not be asked."""

    spec: ReplicaSpec
    epoch: int | None = None  # the recorded owner's epoch (None: a pool nobody claimed)
    owner: str = ""  # the target's description of the owner
    size: int | None = None
    uuid: bytes | None = None
    writer: str | None = None  # the peer of the session writing it now, if any
    # Set when a resync of it began and did not end (see target/owners.py): says by whom, when.
    resync: str | None = None
    error: str | None = None
    timed_out: bool = False  # it answered nothing within the deadline (error says so too)

    def newer_than(self, prev: int) -> bool:
        """True when another initiator claimed this replica since this pool's epoch ``prev``."""
        return (self.epoch is not None and self.epoch != prev
                and epoch_gen(self.epoch) >= epoch_gen(prev))

    def owned_by(self) -> str:
        return self.owner or (f"epoch {show_epoch(self.epoch)}" if self.epoch is not None else "nobody")


def new_epoch(seen: list[int]) -> int:
    """An epoch above every one seen: the next generation after the highest."""
    top = max(seen, default=0)
    return next_epoch(top, secrets.randbits(32)) if epoch_gen(top) < 0xFFFFFFFF else top + 1


def holder(pool: str, mountpoint: str | None = None, command: str = "mount") -> dict[str, Any]:
    """Who this initiator is, for a target to name to the initiators it refuses."""
    out: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "pool": pool,
                           "command": command}
    if mountpoint:
        out["mountpoint"] = mountpoint
    return out


def read_probe(spec: ReplicaSpec, reply: Mapping[str, Any]) -> Probe:
    """What a target said of its pool; its text escaped (printable), since this mount repeats
    it in its errors, its log and its status."""
    owner = reply.get("owner")
    writer = reply.get("writer")
    p = Probe(spec, writer=printable(writer) if isinstance(writer, str) else None)
    if isinstance(owner, dict) and isinstance(owner.get("epoch"), int):
        p.epoch = owner["epoch"]
        p.owner = printable(str(owner.get("described") or ""))
        if owner.get("resync") is not None:
            p.resync = printable(str(owner.get("resync_described") or "a resync began and did not end"))
    if isinstance(reply.get("size"), int):
        p.size = reply["size"]
    raw_uuid = reply.get("uuid")
    if isinstance(raw_uuid, str):
        try:
            p.uuid = bytes.fromhex(raw_uuid)
        except ValueError:
            p.uuid = None
    return p


async def probe_one(spec: ReplicaSpec, token: bytes | None, timeout: float,
                    transport: Transport | None = None, *,
                    wire_protection: str = DEFAULT_PROTECTION) -> Probe:
    tp = transport or transport_for(spec.transport, wire_protection=wire_protection)
    try:
        with trio.fail_after(timeout):
            async with await tp.connect(spec.address, token, lanes=0, timeout=timeout) as session:
                return read_probe(spec, await session.probe_pool(spec.name))
    except TransportError as exc:
        return Probe(spec, error=f"replica {spec}: cannot ask who owns it: {exc}", timed_out=exc.timed_out)
    except trio.TooSlowError:
        return Probe(spec, error=f"replica {spec}: no answer within {timeout:g}s", timed_out=True)


async def probe_replicas(specs: list[ReplicaSpec], token: bytes | None, timeout: float,
                         transport: Transport | None = None, *,
                         wire_protection: str = DEFAULT_PROTECTION) -> list[Probe]:
    """Ask every replica who owns it, in parallel; one Probe per spec, in order."""
    results: list[Probe | None] = [None] * len(specs)

    async def one(i: int, spec: ReplicaSpec) -> None:
        results[i] = await probe_one(spec, token, timeout, transport, wire_protection=wire_protection)

    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(specs):
            nursery.start_soon(one, i, spec)
    return [r for r in results if r is not None]


@dataclass
class Claim:
    """What a mount's replicas said of their owners, and the epoch it claims them under.

    ``epoch`` moves past ``prev`` only when some replica will record it (one is reachable and
    none was taken over), so that a pool mounted alone never outgrows the epoch of the primary
    that may have replaced it meanwhile."""

    prev: int  # the pool's epoch before this mount
    epoch: int  # the epoch this mount runs under: ``prev`` when it claims nothing
    takeover: bool  # -o takeover: claimed above every owner seen
    probes: list[Probe] = field(default_factory=list)
    taken: list[Probe] = field(default_factory=list)  # claimed by another primary since ``prev``
    fencing: list[Probe] = field(default_factory=list)  # such owners a takeover fences

    @property
    def reachable(self) -> list[Probe]:
        return [p for p in self.probes if p.error is None]

    @property
    def epochs(self) -> tuple[int, int]:
        """(lineage, epoch) to claim the replicas with: after a takeover this pool's lineage
        starts at its new epoch, so a replica reached later is claimed like promote's are."""
        return (self.epoch, self.epoch) if self.takeover else (self.prev, self.epoch)

    def held_by(self) -> str:
        """Which replicas another primary holds, and who that is."""
        return "; ".join(f"replica {p.spec} is held by {p.owned_by()}" for p in self.taken)


async def ask_owners(specs: list[ReplicaSpec], prev: int, token: bytes | None, timeout: float,
                     transport: Transport | None = None, *, takeover: bool = False,
                     wire_protection: str = DEFAULT_PROTECTION) -> Claim:
    """Ask every replica who owns it (nothing is claimed) and choose the epoch a mount of the
    pool at epoch ``prev`` claims them under: the next generation, or with ``takeover``, when
    another primary claimed some since ``prev``, one above every epoch seen."""
    probes = await probe_replicas(specs, token, timeout, transport, wire_protection=wire_protection)
    newer = [p for p in probes if p.newer_than(prev)]
    if newer and takeover:
        above = new_epoch([prev, *(p.epoch for p in probes if p.epoch is not None)])
        return Claim(prev, above, takeover, probes, fencing=newer)
    claim = Claim(prev, prev, takeover, probes, taken=newer)
    if not newer and claim.reachable:
        claim.epoch = next_epoch(prev, secrets.randbits(32))
    return claim
