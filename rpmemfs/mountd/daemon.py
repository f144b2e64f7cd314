"""The mount daemon: opens the pool, mounts it with FUSE, serves until unmounted or signalled
(how a mount ends, and `rpmemfs umount` waits for it: unmount.py)."""

from __future__ import annotations

import errno
import gc
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pyfuse3
import trio

from rpmemfs import logs
from rpmemfs.durability import Backlog, Committer, Durability, DurabilityError, StaleTable
from rpmemfs.fs.filesystem import Filesystem
from rpmemfs.fuse import Operations
from rpmemfs.mountd import control
from rpmemfs.mountd.errors import MountError
from rpmemfs.mountd.membership import Membership
from rpmemfs.mountd.options import MountOptions
from rpmemfs.mountd.unmount import Ending, clear_mountpoint, not_durable
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool.header import write_header
from rpmemfs.pool.layout import BLOCK, PoolFormatError, next_epoch, show_epoch
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.replica import ReplicaSet, ReplicaState
from rpmemfs.replica.fencing import holder, new_epoch, probe_replicas
from rpmemfs.replica.spec import PoolSetError, poolset_at
from rpmemfs.replica.table import inspect_table
from rpmemfs.replica.verify import VerifyReport, content_size, pool_chunk
from rpmemfs.transport.base import TransportError
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.transport.tokens import TokenError, chosen_token

log = logging.getLogger("rpmemfs.mount")

class Mounted:
    """A pool opened and served at a mountpoint."""

    ending: Ending | None = None  # how the mount ends: serve() makes it, before mounting
    _syncing: trio.Lock | None = None  # held by the `rpmemfs sync` under way

    def __init__(self, pool: str, mountpoint: str, mo: MountOptions) -> None:
        self.mo = mo
        try:
            ps = poolset_at(pool)
        except PoolSetError as e:
            raise MountError(str(e)) from None
        poolset_specs = ps.replicas if ps is not None else None
        if ps is not None:
            pool = ps.path
        self.pool = os.path.abspath(pool)
        self.mountpoint = os.path.abspath(mountpoint)
        if not os.path.exists(self.pool):
            raise MountError(f"pool {pool} does not exist")
        clear_mountpoint(mountpoint, "rpmemfs:" + self.pool)  # a dead mount of this pool goes
        self.control_path = control.socket_path(self.mountpoint, serving=True)
        try:
            control.prepare_dir(self.control_path)  # refused before anything is claimed
        except OSError as e:
            raise MountError(str(e)) from None
        t0 = time.perf_counter()
        try:
            self.mapping = PoolMapping.open(self.pool, mo.pmem, exclusive=True)
        except PmemError as e:
            raise MountError(str(e)) from None
        failure = ""
        try:
            self.fs = Filesystem.open(self.mapping.buf, self.mapping,
                                      copy_nt=self.mapping.write_nt if self.mapping.is_pmem else None)
        except PoolFormatError as e:
            failure = str(e)
        if failure:
            # Outside the except block, so the traceback's views into the pool are gone.
            try:
                self.mapping.close()
            except BufferError:
                pass  # a view survived; the process is about to exit and unmap anyway
            raise MountError(f"cannot mount {pool}: {failure}")
        gc.freeze()  # the index lives as long as the mount: no collection need walk it again
        table = inspect_table(self.mapping.buf)
        if table.problem:
            log.warning("replica table: %s", table.problem)
        self.specs = poolset_specs if poolset_specs is not None else table.replicas
        self.from_poolset = poolset_specs is not None
        self.membership: Membership | None = None  # connect_replicas makes it
        self.token_file = mo.token_file or table.token_file
        self.table_token_file = table.token_file
        # Replicas that missed barriers: the table says so to anyone who reads the pool; the
        # sync map below says what each one misses.
        self.stale = {s for s in table.stale if s in {str(x) for x in self.specs}}
        self.min_replicas = len(self.specs) if mo.min_replicas is None else mo.min_replicas
        if self.min_replicas > len(self.specs):
            self.mapping.close()
            raise MountError(f"min_replicas={self.min_replicas} but the pool has only "
                             f"{len(self.specs)} replicas")
        self.syncmap = SyncMap(self.mapping.buf, self.fs.hdr, self.mapping.persist)
        # The epoch this mount claims its replicas under (fencing.py); it is written into the
        # pool only once the replicas said nobody else claimed them (connect_replicas).
        self.prev_epoch = self.fs.hdr.epoch
        self.new_epoch = next_epoch(self.prev_epoch, secrets.randbits(32))
        self.header_ranges: list[tuple[int, int]] = []
        self.fenced: str | None = None  # why this pool may not write its replicas, if it may not
        self.clean = False  # set when the last barrier reached every in-sync replica
        self.replicas: ReplicaSet | None = None
        # Local until the replicas are connected (serve() makes the one that serves them).
        self.durability = Durability(self.fs, self.mapping)
        self._ops: Operations | None = None
        self.committer: Committer | None = None  # serve() starts it (-o commit=)
        self._mounted = False
        self.open_seconds = time.perf_counter() - t0

    @property
    def ops(self) -> Operations:
        assert self._ops is not None, "the FUSE operations exist once serve() connected the replicas"
        return self._ops

    def describe(self) -> dict[str, Any]:
        fs = self.fs
        st = fs.statfs()
        return {
            "pool": self.pool,
            "mountpoint": self.mountpoint,
            "uuid": fs.hdr.uuid_str,
            "size": fs.hdr.pool_size,
            "data_size": fs.hdr.data_blocks * BLOCK,
            "used": (st["blocks"] - st["bfree"]) * BLOCK,
            "free": st["bfree"] * BLOCK,
            "inodes": len(fs.inodes),
            "pmem_mode": self.mapping.kind,
            "pmem_requested": self.mapping.requested,
            "persists": {"flush_fence": self.mapping.flushes, "msync": self.mapping.msyncs},
            "fsync_count": self.durability.stats.fsyncs,
            "fsync_latency_us": self.durability.stats.percentiles(),
            **self.ops.counters(),
            "log": {"area": fs.log.active, "generation": fs.log.gen, "used": fs.log.used,
                    "capacity": fs.log.capacity, "records_appended": fs.log.records,
                    "checkpoints": fs.log.checkpoints},
            "replay": {"records": fs.replay_stats[0], "entries": fs.replay_stats[1],
                       "seconds": round(fs.replay_stats[2], 4), "tail_records": fs.replay_tail[0],
                       "tail_bytes": fs.replay_tail[1]},
            "open_seconds": round(self.open_seconds, 4),
            "pid": os.getpid(), "daemon_log": logs.destination(),
            "min_replicas": self.min_replicas,
            "epoch": show_epoch(fs.hdr.epoch),
            "fenced": self.fenced or (self.replicas.taken_over() if self.replicas is not None else None),
            "commit": self.committer.status() if self.committer is not None else {"seconds": 0},
            "replicas": self._replica_status(),
            "oldest_barrier_s": (round(self.replicas.oldest_in_flight(), 3)
                                 if self.replicas is not None else 0.0),
            **self.durability.replication_status(),
            "started": self.durability.stats.started,
        }

    def _replica_status(self) -> list[dict[str, Any]]:
        if self.replicas is not None:
            return self.durability.with_lag(self.replicas.status())
        if self.fenced:
            return [{"address": s.address, "name": s.name, "state": ReplicaState.STALE,
                     "last_error": f"fenced: {self.fenced}"} for s in self.specs]
        return [{"address": s.address, "name": s.name,
                 "state": ReplicaState.STALE if str(s) in self.stale else ReplicaState.CONNECTING}
                for s in self.specs]

    def fuse_options(self) -> set[str]:
        opts = set(pyfuse3.default_options)
        opts |= {"fsname=rpmemfs:" + self.pool, "subtype=rpmemfs"}
        if self.mo.allow_other:
            opts.add("allow_other")
        return opts

    def start(self) -> None:
        try:
            pyfuse3.init(self.ops, self.mountpoint, self.fuse_options())
        except RuntimeError as e:
            raise MountError(f"FUSE mount at {self.mountpoint} failed: {e}") from None
        self._mounted = True
        # Page faults on first stores into a fresh pool cost as much as the copy itself;
        # taking them in the background keeps the mount itself quick for big pools.
        self._populated = threading.Event()
        self._populator = threading.Thread(target=self.mapping.populate, args=(self._populated,),
                                           name="populate", daemon=True)
        self._populator.start()

    def _begin(self, epoch: int) -> None:
        """This mount's epoch is settled: into the pool (when it moved), and the sync map under it."""
        if epoch != self.fs.hdr.epoch:
            self.fs.hdr = replace(self.fs.hdr, epoch=epoch)
            self.header_ranges = write_header(self.mapping.buf, self.fs.hdr)
            self.mapping.persist(self.header_ranges)
        if not self.syncmap.reliable and self.specs:
            log.warning("pool %s was not unmounted cleanly (or its sync map is not its own): "
                        "every replica is compared by checksums before it counts as in sync", self.pool)
        self.syncmap.start(self.fs.hdr, len(self.specs))

    async def connect_replicas(self) -> None:
        """Ask every recorded replica who owns it; then claim them under a new epoch and bring
        them up to date. MountError, with nothing changed, when a replica was taken over by
        another primary (unless min_replicas=0: then this pool mounts alone and writes no
        replica) or fewer than min_replicas can be reached; MountError when fewer than
        min_replicas end up in sync. Those left out are retried in the background."""
        if not self.specs:
            self._begin(self.prev_epoch)
            return
        try:
            token = chosen_token(self.mo.token_file, self.table_token_file)
        except (TokenError, OSError) as e:
            raise MountError(f"token file {self.token_file}: {e}") from None
        wp = self.mo.wire_protection or DEFAULT_PROTECTION  # every connection to a target asks for it
        probes = await probe_replicas(self.specs, token, self.mo.replica_timeout, wire_protection=wp)
        newer = [p for p in probes if p.newer_than(self.prev_epoch)]
        takeover = self.mo.takeover
        if newer and takeover:
            # The operator says this copy wins: claim above every epoch seen, fencing the
            # owner; the replicas are compared in full, since they hold the other's writes.
            log.warning("pool %s takes its replicas over (-o takeover), fencing: %s", self.pool,
                        "; ".join(f"{p.spec} held by {p.owned_by()}" for p in newer))
            self.new_epoch = new_epoch([self.prev_epoch, *(p.epoch for p in probes if p.epoch is not None)])
            for slot in range(len(self.specs)):
                self.syncmap.set_full(slot)
            newer = []
        if newer:
            self.fenced = "; ".join(f"replica {p.spec} is held by {p.owned_by()}" for p in newer)
            if self.min_replicas > 0:
                raise MountError(
                    f"{self.pool} was taken over by another primary (a failover): {self.fenced}. "
                    f"This pool is at epoch {show_epoch(self.prev_epoch)}; mounting it with its "
                    "replicas would split the brain, so nothing was changed. Rejoin it as a replica "
                    "or promote it back (docs/failover.md); -o min_replicas=0 mounts it alone")
            log.error("pool %s was taken over (%s): mounting it alone (min_replicas=0); it writes "
                      "no replica", self.pool, self.fenced)
            self._begin(self.prev_epoch)
            return
        reachable = [p for p in probes if p.error is None]
        if len(reachable) < self.min_replicas:
            why = "; ".join(p.error for p in probes if p.error)
            raise MountError(f"{len(reachable)} of {len(self.specs)} replicas usable, min_replicas="
                             f"{self.min_replicas}; nothing was changed: {why}")
        # Claiming moves the epoch: only when some replica will record it, so that a pool
        # mounted alone never outgrows the primary that may have replaced it meanwhile.
        epoch = self.new_epoch if reachable else self.prev_epoch
        self._begin(epoch)
        rs = await ReplicaSet.open(self.specs, self.mapping.buf, self.fs.hdr.uuid, token,
                                   timeout=self.mo.replica_timeout, min_replicas=self.min_replicas,
                                   syncmap=self.syncmap, wire_protection=wp,
                                   # after a takeover this pool's lineage starts at its new epoch:
                                   # a replica reached later is claimed like promote's are
                                   epoch=(epoch, epoch) if takeover else (self.prev_epoch, epoch),
                                   holder=holder(self.pool, self.mountpoint), takeover=takeover)
        usable = len(rs.in_sync)
        if usable < self.min_replicas:
            why = "; ".join(f"{r['address']}/{r['name']}: {r['last_error']}"
                            for r in rs.status() if r["state"] != ReplicaState.IN_SYNC)
            await rs.aclose()
            raise MountError(f"{usable} of {len(self.specs)} replicas usable, min_replicas="
                             f"{self.min_replicas}: {why}")
        if usable == 0:
            log.warning("mounting %s alone: no replica is usable now (min_replicas=0); "
                        "retrying them in the background", self.pool)
        for r in rs.status():
            if r["state"] != ReplicaState.IN_SYNC:
                log.error("replica %s/%s left out for now: %s", r["address"], r["name"], r["last_error"])
        self.replicas = rs
        table = StaleTable(self.mapping.buf, self.specs, self.table_token_file, self.stale)
        # The new epoch reaches the replicas with the first durability point.
        self.durability = Durability(self.fs, self.mapping, rs, table, carry=self.header_ranges,
                                     backlog=Backlog.for_mode(rs, self.mo.replication, self.mo.max_lag))
        self.durability.note_replicas()
        self.membership = Membership(self.pool, self.specs, rs, self.durability, table, self.mapping.buf,
                                     self.fs.hdr.uuid, (self.prev_epoch, epoch), token,
                                     self.mo.replica_timeout, self.table_token_file,
                                     self._set_min_replicas, self.mo.min_replicas is None, wp)

    def reload_token(self) -> None:
        """SIGHUP: read the token file again, for every connection to a target from now on
        (reconnects, resyncs, replicas added); connections open now keep the token they
        proved. Without a token file each connection reads its user's local token anyway."""
        if not self.token_file:
            log.info("SIGHUP: no token file: connections use the local token as it is when they open")
            return
        try:
            token = chosen_token(self.mo.token_file, self.table_token_file)
        except (TokenError, OSError) as e:
            log.error("SIGHUP: token file %s not reread, the token in use stays: %s", self.token_file, e)
            return
        if self.replicas is not None:
            self.replicas.token = token
        if self.membership is not None:
            self.membership.token = token
        log.info("SIGHUP: token file %s reread", self.token_file)

    def _set_min_replicas(self, n: int) -> None:
        assert self.replicas is not None  # (membership exists only with replicas)
        self.min_replicas = self.replicas.min_replicas = n

    async def _replica(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs replica add|remove MOUNTPOINT ADDRESS/NAME [--force]` (membership.py)."""
        if self.from_poolset:
            return {"error": f"{self.pool} was mounted from a pool-set file, which lists its replicas: "
                             "edit that file and mount again"}
        if self.membership is None:
            why = f"fenced ({self.fenced})" if self.fenced else "mounted without replicas"
            return {"error": f"{self.pool} is {why}: replicas are added only to a mount that has some"}
        return await self.membership.request(args, send, self.min_replicas)

    def control_handlers(self) -> dict[str, control.Handler]:
        async def status(args: list[str], send: control.Send) -> dict[str, Any]:
            return self.describe()

        assert self.ending is not None
        return {"status": status, "verify": self._verify, "sync": self._sync,
                "umount": self.ending.umount, "flush": self._flush, "replica": self._replica}

    async def _flush(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs flush MOUNTPOINT`: a durability point now, local and on the replicas (what
        `sync -f` cannot ask of a FUSE daemon; see durability/commit.py)."""
        t0 = time.monotonic()
        try:
            # Shielded: an asker that goes away must not cut a point short in flight.
            with trio.CancelScope(shield=True):
                await self.durability.flush()
        except DurabilityError as e:
            return {"error": f"flush of {self.mountpoint} failed: {e}"}
        rs = self.replicas
        return {"flushed": self.mountpoint, "seconds": round(time.monotonic() - t0, 6),
                "replicas": len(self.specs), "in_sync": len(rs.in_sync) if rs is not None else 0}

    async def _verify(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs verify MOUNTPOINT`: the live pool against every replica."""
        rs = self.replicas
        if rs is None:
            return {"error": f"{self.pool} has no replicas to verify"}
        try:
            chunk = int(args[0]) if args else pool_chunk(self.mapping.buf)
        except ValueError:
            return {"error": f"bad chunk size {args[0]!r}"}
        if chunk < 4096 or chunk % 4096 or chunk > 64 << 20:
            return {"error": "the chunk must be a multiple of 4K, at most 64M"}
        t0 = time.monotonic()

        async def work(count: Callable[[int], None]) -> dict[str, Any]:
            report = VerifyReport(self.pool, len(self.mapping.buf), chunk)
            report.replicas = await rs.verify(chunk, self.durability.flush, count)
            report.seconds = time.monotonic() - t0
            return report.as_dict()

        return await control.with_progress(content_size(self.mapping.buf) * len(rs.replicas), send, work)

    async def _sync(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs sync MOUNTPOINT`: verify-and-repair of every in-sync replica now; the
        others are compared in full when they are back."""
        rs = self.replicas
        if rs is None:
            return {"error": f"{self.pool} has no replicas to sync"}
        t0 = time.monotonic()
        if self._syncing is None:
            self._syncing = trio.Lock()
        syncing = self._syncing

        async def work(count: Callable[[int], None]) -> dict[str, Any]:
            # One at a time: two repairs of one replica would share its progress record and
            # its bulk lane. A second sync (its asker's first one was killed while the work
            # went on, say) starts when the first ends.
            async with syncing:
                return await repair_all(count)

        async def repair_all(count: Callable[[int], None]) -> dict[str, Any]:
            results: list[dict[str, Any]] = []
            for r in rs.replicas:
                entry: dict[str, Any] = {"replica": str(r.spec), "state": r.state}
                if r.state == ReplicaState.IN_SYNC:
                    try:
                        entry.update(await rs.repair(r, count))
                    except (TransportError, trio.TooSlowError) as exc:
                        # The differences it found are not in the sync map: without this its
                        # resync would send only what barriers missed, and leave them.
                        self.syncmap.set_full(r.slot)
                        entry["error"] = f"repair failed, the replica is stale now: {exc}"
                        self.durability.note_replicas()
                    except trio.Cancelled:
                        # The mount is ending halfway through the repair: some differing
                        # chunks went, some did not, and only a full comparison knows which.
                        self.syncmap.set_full(r.slot)
                        raise
                else:
                    self.syncmap.set_full(r.slot)
                    entry["error"] = (f"not in sync ({r.state}: {r.last_error}); it is compared in "
                                      "full when it is back")
                results.append(entry)
            return {"pool": self.pool, "size": len(self.mapping.buf), "chunk": pool_chunk(self.mapping.buf),
                    "seconds": round(time.monotonic() - t0, 3), "replicas": results,
                    "clean": all("error" not in e for e in results)}

        return await control.with_progress(content_size(self.mapping.buf) * len(rs.replicas), send, work)

    async def serve(self, ready: Callable[[], None] = lambda: None) -> None:
        await self.connect_replicas()
        # A long tail left by a crash would be replayed by every later mount, after the next
        # crash too. Now: a refused mount changes nothing. Replicas get it with the next point.
        self.fs.checkpoint_if_long("at mount")
        self._ops = Operations(self.fs, self.durability, self.describe, xattrs=self.mo.xattrs,
                               poll_us=self.mo.poll_us, writeback_cache=self.mo.writeback_cache)
        self.ending = ending = Ending(self.mountpoint, self.pool)
        self.start()
        ready()
        # replication=async: the senders outlive the tasks below, the last point drains them.
        async with self.durability.senders():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ending.signals, pyfuse3.terminate, self.reload_token)
                nursery.start_soon(ending.watch, pyfuse3.terminate, self.ops.handles_open)
                nursery.start_soon(self.ops.poller.run)
                if self.replicas is not None:
                    nursery.start_soon(self.replicas.keep, self.durability.note_replicas)
                if self.mo.commit:
                    self.committer = Committer(self.durability, self.mo.commit)
                    nursery.start_soon(self.committer.run)
                await nursery.start(control.serve, self.control_path, self.control_handlers())
                stop_metrics = self._serve_metrics()
                try:
                    await pyfuse3.main()
                except OSError as e:
                    # Once detached, the last close aborts the connection: ECONNABORTED is the end.
                    if not (ending.detached and e.errno == errno.ECONNABORTED):
                        raise
                finally:
                    stop_metrics()
                nursery.cancel_scope.cancel()
            await self._last_barrier()

    def _serve_metrics(self) -> Callable[[], None]:
        if self.mo.metrics is None:
            return lambda: None
        from rpmemfs.mountd.metrics import serve_mount_metrics

        try:
            return serve_mount_metrics(self.mo.metrics, self.metrics_snapshot)
        except OSError as e:
            # Metrics are for watching the mount, not a reason to refuse it.
            log.error("metrics: cannot serve on %s: %s", self.mo.metrics.url(), e.strerror or e)
            return lambda: None

    def metrics_snapshot(self) -> dict[str, Any]:
        """describe() and the latency histograms, taken together (on the trio thread)."""
        hists = {f"{r.spec.address}/{r.spec.name}": r.latency.snapshot()
                 for r in (self.replicas.replicas if self.replicas else [])}
        return {**self.describe(), "fsync_histogram": self.durability.stats.histogram.snapshot(),
                "replica_histograms": hists}

    async def _last_barrier(self) -> None:
        """Unmounted: make everything durable everywhere, with a checkpoint if the log is long."""
        try:
            await self.durability.flush()
            if self.fs.checkpoint_if_long("at unmount"):
                await self.durability.flush()
            # Every in-sync replica has all of the pool, the others' misses are in the map.
            self.clean = True
        except Exception as e:
            log.error("final durability point failed: %s", e)
        if self.replicas is not None:
            await self.replicas.aclose()

    def finish(self) -> None:
        if self._mounted:
            self._populated.set()  # stop the populate thread before the mapping goes away
            self._populator.join()
        last: dict[str, Any] = {"closed": True, "clean": False, "pool": self.pool}
        try:
            served = self._ops is not None  # a mount refused before serving leaves the pool as it was
            if served:
                self.durability.sync_local()  # replicas were served by _last_barrier, if at all
            if served and (self.clean or not self.specs):
                self.syncmap.finish()
                last["clean"] = True
            elif not served:
                last["error"] = "the mount was refused before it served; the pool is as it was"
            else:
                taken = self.replicas.taken_over() if self.replicas is not None else None
                last["error"] = not_durable(taken, logs.destination())
        except Exception as e:
            last["error"] = f"the pool could not be made durable: {e}"
            raise
        finally:
            if self._mounted:
                # Once detached, the path may be someone else's mount point already: closing
                # /dev/fuse is what ends the mount (and whatever still had files open there).
                pyfuse3.close(unmount=self.ending is None or not self.ending.detached)
            try:
                self.mapping.close()
            except BufferError:
                pass  # a view survived a failure; the process exits and unmaps anyway
            if self.ending is not None:
                self.ending.tell(last)
