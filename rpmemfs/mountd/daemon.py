"""The mount daemon: serves a pool at a mountpoint with FUSE until unmounted or signalled.
Its layers (mapping, filesystem, replica set, durability) are built by assemble.py; this
module serves them: the FUSE edge, the control socket's requests, the last barrier, and how
the mount ends (with `rpmemfs umount` waiting for it: unmount.py)."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

from rpmemfs import logs
from rpmemfs.durability import Committer, DurabilityError
from rpmemfs.fuse import Operations
from rpmemfs.mountd import control
from rpmemfs.mountd.assemble import Layers, assemble
from rpmemfs.mountd.errors import MountError
from rpmemfs.mountd.options import MountOptions
from rpmemfs.mountd.unmount import Ending, clear_mountpoint, not_durable
from rpmemfs.pool.layout import BLOCK, show_epoch
from rpmemfs.replica import ReplicaState
from rpmemfs.replica.spec import PoolSetError, poolset_at
from rpmemfs.replica.verify import VerifyReport, content_size, pool_chunk
from rpmemfs.transport.base import TransportError
from rpmemfs.transport.tokens import TokenError, chosen_token

log = logging.getLogger("rpmemfs.mount")


def _connection_aborted(exc: BaseException) -> bool:
    """Whether ``exc`` is the kernel's ECONNABORTED on /dev/fuse, alone or from every worker
    that was reading the device (a group: under load two of them get it at once, and the
    group once failed a clean unmount as exit 1)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_connection_aborted(e) for e in exc.exceptions)
    return isinstance(exc, OSError) and exc.errno == errno.ECONNABORTED


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
        self.poolset = ps.replicas if ps is not None else None
        if ps is not None:
            pool = ps.path
        self.named = pool  # as the command named it: what a refusal says
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
        self._layers: Layers | None = None  # serve() assembles them
        self.clean = False  # set when the last barrier reached every in-sync replica
        self._ops: Operations | None = None
        self.committer: Committer | None = None  # serve() starts it (-o commit=)
        self._mounted = False

    @property
    def layers(self) -> Layers:
        assert self._layers is not None, "the layers exist once serve() assembled them"
        return self._layers

    @property
    def ops(self) -> Operations:
        assert self._ops is not None, "the FUSE operations exist once serve() connected the replicas"
        return self._ops

    def describe(self) -> dict[str, Any]:
        la = self.layers
        fs = la.fs
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
            "pmem_mode": la.mapping.kind,
            "pmem_requested": la.mapping.requested,
            "persists": {"flush_fence": la.mapping.flushes, "msync": la.mapping.msyncs},
            "fsync_count": la.durability.stats.fsyncs,
            "fsync_latency_us": la.durability.stats.percentiles(),
            **self.ops.counters(),
            "log": {"area": fs.log.active, "generation": fs.log.gen, "used": fs.log.used,
                    "capacity": fs.log.capacity, "records_appended": fs.log.records,
                    "checkpoints": fs.log.checkpoints},
            "replay": {"records": fs.replay_stats[0], "entries": fs.replay_stats[1],
                       "seconds": round(fs.replay_stats[2], 4), "tail_records": fs.replay_tail[0],
                       "tail_bytes": fs.replay_tail[1]},
            "open_seconds": round(la.open_seconds, 4),
            "pid": os.getpid(), "daemon_log": logs.destination(),
            "min_replicas": la.min_replicas,
            "epoch": show_epoch(fs.hdr.epoch),
            "fenced": la.fenced or (la.replicas.taken_over() if la.replicas is not None else None),
            "commit": self.committer.status() if self.committer is not None else {"seconds": 0},
            "replicas": self._replica_status(),
            "oldest_barrier_s": (round(la.replicas.oldest_in_flight(), 3)
                                 if la.replicas is not None else 0.0),
            **la.durability.replication_status(),
            "started": la.durability.stats.started,
        }

    def _replica_status(self) -> list[dict[str, Any]]:
        la = self.layers
        if la.replicas is not None:
            return la.durability.with_lag(la.replicas.status())
        if la.fenced:
            return [{"address": s.address, "name": s.name, "state": ReplicaState.STALE,
                     "last_error": f"fenced: {la.fenced}"} for s in la.specs]
        return [{"address": s.address, "name": s.name,
                 "state": ReplicaState.STALE if str(s) in la.stale else ReplicaState.CONNECTING}
                for s in la.specs]

    def fuse_options(self) -> set[str]:
        opts = set(pyfuse3.default_options)
        opts |= {"fsname=rpmemfs:" + self.pool, "subtype=rpmemfs"}
        if self.mo.allow_other:
            opts.add("allow_other")
        return opts

    def start(self) -> None:
        la = self.layers
        try:
            pyfuse3.init(self.ops, self.mountpoint, self.fuse_options())
        except RuntimeError as e:
            raise MountError(f"FUSE mount at {self.mountpoint} failed: {e}") from None
        self._mounted = True
        # Page faults on first stores into a fresh pool cost as much as the copy itself;
        # taking them in the background keeps the mount itself quick for big pools.
        self._populated = threading.Event()
        self._populator = threading.Thread(target=la.mapping.populate, args=(self._populated,),
                                           name="populate", daemon=True)
        self._populator.start()

    def reload_token(self) -> None:
        """SIGHUP: read the token file again, for every connection to a target from now on
        (reconnects, resyncs, replicas added); connections open now keep the token they
        proved. Without a token file each connection reads its user's local token anyway."""
        la = self.layers
        if not la.token_file:
            log.info("SIGHUP: no token file: connections use the local token as it is when they open")
            return
        try:
            token = chosen_token(self.mo.token_file, la.table_token_file)
        except (TokenError, OSError) as e:
            log.error("SIGHUP: token file %s not reread, the token in use stays: %s", la.token_file, e)
            return
        if la.replicas is not None:
            la.replicas.token = token
        if la.membership is not None:
            la.membership.token = token
        log.info("SIGHUP: token file %s reread", la.token_file)

    async def _replica(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs replica add|remove MOUNTPOINT ADDRESS/NAME [--force]` (membership.py)."""
        la = self.layers
        if la.from_poolset:
            return {"error": f"{self.pool} was mounted from a pool-set file, which lists its replicas: "
                             "edit that file and mount again"}
        if la.membership is None:
            why = f"fenced ({la.fenced})" if la.fenced else "mounted without replicas"
            return {"error": f"{self.pool} is {why}: replicas are added only to a mount that has some"}
        return await la.membership.request(args, send, la.min_replicas)

    def control_handlers(self) -> dict[str, control.Handler]:
        async def status(args: list[str], send: control.Send) -> dict[str, Any]:
            return self.describe()

        assert self.ending is not None
        return {"status": status, "verify": self._verify, "sync": self._sync,
                "umount": self.ending.umount, "flush": self._flush, "replica": self._replica}

    async def _flush(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs flush MOUNTPOINT`: a durability point now, local and on the replicas (what
        `sync -f` cannot ask of a FUSE daemon; see durability/commit.py)."""
        la = self.layers
        t0 = time.monotonic()
        try:
            # Shielded: an asker that goes away must not cut a point short in flight.
            with trio.CancelScope(shield=True):
                await la.durability.flush()
        except DurabilityError as e:
            return {"error": f"flush of {self.mountpoint} failed: {e}"}
        rs = la.replicas
        return {"flushed": self.mountpoint, "seconds": round(time.monotonic() - t0, 6),
                "replicas": len(la.specs), "in_sync": len(rs.in_sync) if rs is not None else 0}

    async def _verify(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs verify MOUNTPOINT`: the live pool against every replica."""
        la = self.layers
        rs = la.replicas
        if rs is None:
            return {"error": f"{self.pool} has no replicas to verify"}
        try:
            chunk = int(args[0]) if args else pool_chunk(la.mapping.buf)
        except ValueError:
            return {"error": f"bad chunk size {args[0]!r}"}
        if chunk < 4096 or chunk % 4096 or chunk > 64 << 20:
            return {"error": "the chunk must be a multiple of 4K, at most 64M"}
        t0 = time.monotonic()

        async def work(count: Callable[[int], None]) -> dict[str, Any]:
            report = VerifyReport(self.pool, len(la.mapping.buf), chunk)
            report.replicas = await rs.verify(chunk, la.durability.flush, count)
            report.seconds = time.monotonic() - t0
            return report.as_dict()

        return await control.with_progress(content_size(la.mapping.buf) * len(rs.replicas), send, work)

    async def _sync(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs sync MOUNTPOINT`: verify-and-repair of every in-sync replica now; the
        others are compared in full when they are back."""
        la = self.layers
        rs = la.replicas
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
                        la.syncmap.set_full(r.slot)
                        entry["error"] = f"repair failed, the replica is stale now: {exc}"
                        la.durability.note_replicas()
                    except trio.Cancelled:
                        # The mount is ending halfway through the repair: some differing
                        # chunks went, some did not, and only a full comparison knows which.
                        la.syncmap.set_full(r.slot)
                        raise
                else:
                    la.syncmap.set_full(r.slot)
                    entry["error"] = (f"not in sync ({r.state}: {r.last_error}); it is compared in "
                                      "full when it is back")
                results.append(entry)
            return {"pool": self.pool, "size": len(la.mapping.buf), "chunk": pool_chunk(la.mapping.buf),
                    "seconds": round(time.monotonic() - t0, 3), "replicas": results,
                    "clean": all("error" not in e for e in results)}

        return await control.with_progress(content_size(la.mapping.buf) * len(rs.replicas), send, work)

    async def serve(self, ready: Callable[[], None] = lambda: None) -> None:
        self._layers = la = await assemble(self.named, self.mountpoint, self.mo, self.poolset)
        # A long tail left by a crash would be replayed by every later mount, after the next
        # crash too. Now: a refused mount changes nothing. Replicas get it with the next point.
        la.fs.checkpoint_if_long("at mount")
        self._ops = Operations(la.fs, la.durability, self.describe, xattrs=self.mo.xattrs,
                               poll_us=self.mo.poll_us, writeback_cache=self.mo.writeback_cache)
        self.ending = ending = Ending(self.mountpoint, self.pool)
        self.start()
        ready()
        # replication=async: the senders outlive the tasks below, the last point drains them.
        async with la.durability.senders():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ending.signals, pyfuse3.terminate, self.reload_token)
                nursery.start_soon(ending.watch, pyfuse3.terminate, self.ops.handles_open)
                nursery.start_soon(self.ops.poller.run)
                nursery.start_soon(self.ops.fsyncs.run)
                if la.replicas is not None:
                    nursery.start_soon(la.replicas.keep, la.durability.note_replicas)
                if self.mo.commit:
                    self.committer = Committer(la.durability, self.mo.commit)
                    nursery.start_soon(self.committer.run)
                await nursery.start(control.serve, self.control_path, self.control_handlers())
                stop_metrics = self._serve_metrics()
                try:
                    await pyfuse3.main()
                except BaseException as e:
                    # Once detached, the last close aborts the connection: ECONNABORTED is the end.
                    if not (ending.detached and _connection_aborted(e)):
                        raise
                finally:
                    stop_metrics()
                # fsyncs answered later were not waited for by pyfuse3's tasks: they are now.
                await self.ops.fsyncs.answered()
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
        la = self.layers
        hists = {f"{r.spec.address}/{r.spec.name}": r.latency.snapshot()
                 for r in (la.replicas.replicas if la.replicas else [])}
        return {**self.describe(), "fsync_histogram": la.durability.stats.histogram.snapshot(),
                "replica_histograms": hists}

    async def _last_barrier(self) -> None:
        """Unmounted: make everything durable everywhere, with a checkpoint if the log is long."""
        la = self.layers
        try:
            await la.durability.flush()
            if la.fs.checkpoint_if_long("at unmount"):
                await la.durability.flush()
            # Every in-sync replica has all of the pool, the others' misses are in the map.
            self.clean = True
        except Exception as e:
            log.error("final durability point failed: %s", e)
        if la.replicas is not None:
            await la.replicas.aclose()

    def finish(self) -> None:
        if self._mounted:
            self._populated.set()  # stop the populate thread before the mapping goes away
            self._populator.join()
        last: dict[str, Any] = {"closed": True, "clean": False, "pool": self.pool}
        la = self._layers  # None: refused while assembling, which closed what it had opened
        try:
            # A mount refused before serving leaves the pool as it was.
            if self._ops is None or la is None:
                last["error"] = "the mount was refused before it served; the pool is as it was"
            else:
                la.durability.sync_local()  # replicas were served by _last_barrier, if at all
                if self.clean or not la.specs:
                    la.syncmap.finish()
                    last["clean"] = True
                else:
                    taken = la.replicas.taken_over() if la.replicas is not None else None
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
                if la is not None:
                    la.mapping.close()
            except BufferError:
                pass  # a view survived a failure; the process exits and unmaps anyway
            if self.ending is not None:
                self.ending.tell(last)
