"""Assembling a mount: the one function that builds a mounted pool's layers (the mapping, the
filesystem, the replica set and durability), as JuiceFS's vfs.NewVFS does. No layer wires
another by hand; the daemon (daemon.py) serves what ``assemble`` returns.

``assemble`` takes these steps, in this order:

1. Open: the pool mapped for this process alone (pmem.py), the filesystem opened on it
   (fs/recovery.py: the header, replay, what a crash left).
2. The replica table (replica/table.py): the replicas (a pool-set file's list instead, when
   the pool was named by one), those it names stale, the token file; min_replicas checked
   against them. The sync map (pool/syncmap.py) read.
3. The owners (replica/fencing.py, ``ask_owners``): every replica's target says who claimed
   it last, and the epoch this mount claims under is chosen. A pool another primary took
   over is refused (with min_replicas=0 it is mounted alone and writes no replica); with
   -o takeover every replica is compared in full; too few reachable replicas are refused.
4. The epoch begins: into both header copies when it moved (pool/header.py, ``write_epoch``),
   and the sync map started under it.
5. The replica set opens (replica/replica_set.py), claiming every replica under the epoch
   and bringing it in sync; fewer than min_replicas in sync are refused.
6. Durability over the replica set (durability/): the stale table, the backlog of
   replication=async, and the header ranges of step 4, which its first point carries to the
   replicas. Then membership (membership.py: `rpmemfs replica add|remove`).

Without replicas, or taken over, the mount stops after step 4 with local durability. Steps 2
and 3 claim nothing and move no epoch: a mount refused there leaves the pool's epoch and every
replica's owner as they were. A step that refuses (MountError) closes what the steps before
it opened.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass

from rpmemfs.durability import Backlog, Durability, StaleTable
from rpmemfs.fs.filesystem import Filesystem
from rpmemfs.mountd.errors import MountError
from rpmemfs.mountd.membership import Membership
from rpmemfs.mountd.options import MountOptions
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool.header import write_epoch
from rpmemfs.pool.layout import PoolFormatError, show_epoch
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.ranges import Ranges
from rpmemfs.replica import ReplicaSet, ReplicaState
from rpmemfs.replica.fencing import Claim, ask_owners, holder
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import inspect_table
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.transport.tokens import TokenError, chosen_token

log = logging.getLogger("rpmemfs.mount")


@dataclass
class Layers:
    """A mount's layers, as ``assemble`` built them, and what it read on the way."""

    pool: str
    specs: list[ReplicaSpec]  # the replica list: shared with the stale table and membership
    from_poolset: bool  # the list is a pool-set file's, not the table's
    mapping: PoolMapping
    fs: Filesystem
    syncmap: SyncMap
    stale: set[str]  # the replicas the table named stale at mount
    token_file: str | None  # the option's, else the table's: what SIGHUP reads again
    table_token_file: str | None
    min_replicas: int
    durability: Durability
    open_seconds: float  # steps 1 and 2
    fenced: str | None = None  # why this pool may not write its replicas, if it may not
    replicas: ReplicaSet | None = None
    membership: Membership | None = None

    def set_min_replicas(self, n: int) -> None:
        """The policy's new value (membership changed the replicas)."""
        assert self.replicas is not None  # (membership exists only with replicas)
        self.min_replicas = self.replicas.min_replicas = n


async def assemble(pool: str, mountpoint: str, mo: MountOptions,
                   poolset: list[ReplicaSpec] | None = None) -> Layers:
    """The layers of ``pool`` mounted at ``mountpoint`` (see the module's text for the steps);
    ``poolset``: the replicas of the pool-set file that named it. MountError when refused,
    naming the pool as the caller did."""
    layers = _open(pool, mo, poolset)  # 1, 2
    try:
        if not layers.specs:
            _begin(layers, layers.fs.hdr.epoch)
            return layers
        await _connect(layers, mountpoint, mo)  # 3 to 6
    except BaseException:
        try:
            layers.mapping.close()
        except BufferError:
            pass  # a view survived a failure; the process exits and unmaps anyway
        raise
    return layers


def _open(pool: str, mo: MountOptions, poolset: list[ReplicaSpec] | None) -> Layers:
    """Steps 1 and 2."""
    path = os.path.abspath(pool)
    t0 = time.perf_counter()
    try:
        mapping = PoolMapping.open(path, mo.pmem, exclusive=True)
    except PmemError as e:
        raise MountError(str(e)) from None
    failure = ""
    try:
        fs = Filesystem.open(mapping.buf, mapping, copy_nt=mapping.write_nt if mapping.is_pmem else None)
    except PoolFormatError as e:
        failure = str(e)
    if failure:
        # Outside the except block, so the traceback's views into the pool are gone.
        try:
            mapping.close()
        except BufferError:
            pass  # a view survived; the process is about to exit and unmap anyway
        raise MountError(f"cannot mount {pool}: {failure}")
    gc.freeze()  # the index lives as long as the mount: no collection need walk it again
    table = inspect_table(mapping.buf)
    if table.problem:
        log.warning("replica table: %s", table.problem)
    specs = poolset if poolset is not None else table.replicas
    min_replicas = len(specs) if mo.min_replicas is None else mo.min_replicas
    if min_replicas > len(specs):
        mapping.close()
        raise MountError(f"min_replicas={min_replicas} but the pool has only {len(specs)} replicas")
    return Layers(
        pool=path, specs=specs, from_poolset=poolset is not None, mapping=mapping, fs=fs,
        syncmap=SyncMap(mapping.buf, fs.hdr, mapping.persist),
        # Replicas that missed barriers: the table says so to anyone who reads the pool; the
        # sync map says what each one misses.
        stale={s for s in table.stale if s in {str(x) for x in specs}},
        token_file=mo.token_file or table.token_file, table_token_file=table.token_file,
        min_replicas=min_replicas,
        durability=Durability(fs, mapping),  # local until replicas are connected (step 6)
        open_seconds=time.perf_counter() - t0)


def _begin(layers: Layers, epoch: int) -> Ranges:
    """Step 4: the epoch into the pool (when it moved), the sync map under it; the header
    ranges written."""
    written: Ranges = []
    if epoch != layers.fs.hdr.epoch:
        layers.fs.hdr, written = write_epoch(layers.mapping.buf, layers.fs.hdr, epoch, layers.mapping.persist)
    if not layers.syncmap.reliable and layers.specs:
        log.warning("pool %s was not unmounted cleanly (or its sync map is not its own): "
                    "every replica is compared by checksums before it counts as in sync", layers.pool)
    layers.syncmap.start(layers.fs.hdr, len(layers.specs))
    return written


async def _connect(layers: Layers, mountpoint: str, mo: MountOptions) -> None:
    """Steps 3 to 6, for a pool with replicas."""
    try:
        token = chosen_token(mo.token_file, layers.table_token_file)
    except (TokenError, OSError) as e:
        raise MountError(f"token file {layers.token_file}: {e}") from None
    wp = mo.wire_protection or DEFAULT_PROTECTION  # every connection to a target asks for it
    claim = await ask_owners(layers.specs, layers.fs.hdr.epoch, token, mo.replica_timeout,
                             takeover=mo.takeover, wire_protection=wp)
    if not _may_claim(layers, claim):
        _begin(layers, claim.prev)
        return
    header = _begin(layers, claim.epoch)
    rs = await ReplicaSet.open(layers.specs, layers.mapping.buf, layers.fs.hdr.uuid, token,
                               timeout=mo.replica_timeout, min_replicas=layers.min_replicas,
                               syncmap=layers.syncmap, wire_protection=wp, epoch=claim.epochs,
                               holder=holder(layers.pool, mountpoint), takeover=claim.takeover,
                               unreachable=unanswered(claim))
    usable = len(rs.in_sync)
    if usable < layers.min_replicas:
        why = "; ".join(f"{r['address']}/{r['name']}: {r['last_error']}"
                        for r in rs.status() if r["state"] != ReplicaState.IN_SYNC)
        await rs.aclose()
        raise MountError(f"{usable} of {len(layers.specs)} replicas usable, min_replicas="
                         f"{layers.min_replicas}: {why}")
    if usable == 0:
        log.warning("mounting %s alone: no replica is usable now (min_replicas=0); "
                    "retrying them in the background", layers.pool)
    for r in rs.status():
        if r["state"] != ReplicaState.IN_SYNC:
            log.error("replica %s/%s left out for now: %s", r["address"], r["name"], r["last_error"])
    layers.replicas = rs
    table = StaleTable(layers.mapping.buf, layers.specs, layers.table_token_file, layers.stale)
    # The new epoch reaches the replicas with the first durability point.
    layers.durability = Durability(layers.fs, layers.mapping, rs, table, carry=header,
                                   backlog=Backlog.for_mode(rs, mo.replication, mo.max_lag))
    layers.durability.note_replicas()
    layers.membership = Membership(layers.pool, layers.specs, rs, layers.durability, table,
                                   layers.mapping.buf, layers.fs.hdr.uuid, (claim.prev, claim.epoch),
                                   token, mo.replica_timeout, layers.table_token_file,
                                   layers.set_min_replicas, mo.min_replicas is None, wp)


def unanswered(claim: Claim) -> dict[str, str]:
    """The replicas that did not answer who owns them: the set does not wait for them a second
    time (a dead node's address answers nothing, and each wait is a whole replica_timeout);
    they are retried in the background, as any replica left out is."""
    return {str(p.spec): p.error for p in claim.probes if p.timed_out and p.error}


def _may_claim(layers: Layers, claim: Claim) -> bool:
    """Step 3's policy: whether the mount claims its replicas (False: it mounts alone, taken
    over, with min_replicas=0); MountError, with nothing changed, when it may not mount."""
    if claim.fencing:
        # The operator says this copy wins: the owner is fenced; the replicas are compared in
        # full, since they hold the other's writes.
        log.warning("pool %s takes its replicas over (-o takeover), fencing: %s", layers.pool,
                    "; ".join(f"{p.spec} held by {p.owned_by()}" for p in claim.fencing))
        for slot in range(len(layers.specs)):
            layers.syncmap.set_full(slot)
    if claim.taken:
        layers.fenced = claim.held_by()
        if layers.min_replicas > 0:
            raise MountError(
                f"{layers.pool} was taken over by another primary (a failover): {layers.fenced}. "
                f"This pool is at epoch {show_epoch(claim.prev)}; mounting it with its "
                "replicas would split the brain, so nothing was changed. Rejoin it as a replica "
                "or promote it back (docs/failover.md); -o min_replicas=0 mounts it alone")
        log.error("pool %s was taken over (%s): mounting it alone (min_replicas=0); it writes "
                  "no replica", layers.pool, layers.fenced)
        return False
    if len(claim.reachable) < layers.min_replicas:
        why = "; ".join(p.error for p in claim.probes if p.error)
        raise MountError(f"{len(claim.reachable)} of {len(layers.specs)} replicas usable, min_replicas="
                         f"{layers.min_replicas}; nothing was changed: {why}")
    return True
