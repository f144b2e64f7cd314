"""Mount-time recovery: from a pool's bytes to a filesystem ready for its first operation.

``replay`` checks the header (repairing a damaged copy), reads the log (rpmemfs.fs.log scan)
and rebuilds the index and the block map from it (rpmemfs.fs.replay). Once the filesystem
is assembled on them (rpmemfs.fs.filesystem), ``settle`` finishes what a crash left: it
erases the records of a point that never ended, takes back the preallocated blocks that
still read as zeros, and frees the orphans (files unlinked while open) by a record that the
first durability point makes durable, on the replicas too.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rpmemfs.changeset import Persister
from rpmemfs.fs.alloc import Allocator
from rpmemfs.fs.changes import ChangeTracker
from rpmemfs.fs.data import Data
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.log import Log, LogScan, scan
from rpmemfs.fs.namespace import Namespace
from rpmemfs.fs.replay import ROOT_INO, Index
from rpmemfs.pool.header import read_header, write_header
from rpmemfs.pool.layout import BACKUP_OFF, BLOCK, BLOCK_SHIFT, HEADER_BYTES, Header, PoolFormatError

log = logging.getLogger("rpmemfs.fs")

# At mount, blocks logged as preallocated are read to tell which are still zeros, up to
# this many (64 MiB); past it they all count as written.
PREALLOC_CHECK = 16384


@dataclass
class Replayed:
    """What replay rebuilt, for the filesystem to be assembled on."""

    hdr: Header
    found: LogScan
    index: Index
    log: Log
    alloc: Allocator
    stats: tuple[int, int, float]  # records and entries replayed, and the seconds it took
    tail: tuple[int, int]  # records and bytes replayed after the snapshot


def replay(buf: memoryview, persister: Persister, repair: bool) -> Replayed:
    """The header checked (a damaged copy rewritten when ``repair``), the log read and
    applied; PoolFormatError when the pool cannot be mounted."""
    if len(buf) < HEADER_BYTES + BACKUP_OFF:
        raise PoolFormatError(f"pool file is truncated: {len(buf)} bytes is too small for a pool")
    hdr, problems = read_header(buf)
    if len(buf) < hdr.pool_size:
        raise PoolFormatError(
            f"pool file is truncated: header says {hdr.pool_size} bytes, file has {len(buf)}")
    if problems and repair:
        persister.persist(write_header(buf, hdr))
        log.warning("pool header repaired: %s", problems[0])
    t0 = time.perf_counter()
    # Replay makes a few objects per record and per inode, which the cyclic collector
    # would walk again and again while they are made (a third of the time of a mount of
    # 300,000 files), finding nothing to free.
    collecting = gc.isenabled()
    gc.disable()
    try:
        found = scan(buf, hdr)
        index = Index()
        try:
            entries = index.apply(r.payload for r in found.records)
        except ValueError as e:  # an entry this version does not know (a newer pool format)
            raise PoolFormatError(f"log replay failed: {e}") from None
        if index.problems:
            raise PoolFormatError("log replay found inconsistencies: " + "; ".join(index.problems[:5]))
        if ROOT_INO not in index.inodes:
            raise PoolFormatError("log replay produced no root directory")
        alloc = Allocator(hdr.data_blocks)
        alloc.mark_blocks(node.blocks for node in index.inodes.values() if node.blocks)
        log_ = Log(buf, hdr, found)
    finally:
        if collecting:
            gc.enable()
    dt = time.perf_counter() - t0
    snap_end = found.area_header.snap_end_seq
    tail = sum(1 for r in found.records if r.seq > snap_end)
    return Replayed(hdr, found, index, log_, alloc, (len(found.records), entries, dt),
                    (tail, log_.tail_bytes))


def settle(r: Replayed, changes: ChangeTracker, namespace: Namespace, data: Data, repair: bool,
           progress: Callable[[str], None] | None = None) -> None:
    """What a crash left, finished on the assembled filesystem (see the module's docstring)."""
    records, entries, dt = r.stats
    log.info("replayed %d records (%d after the snapshot, %d entries, %d inodes) in %.3f s",
             records, r.tail[0], entries, len(r.index.inodes), dt)
    if progress:
        progress(f"replayed {records} records, {len(r.index.inodes)} inodes in {dt:.2f} s")
    if r.found.stale is not None and repair:
        erase_stale(data.buf, changes, *r.found.stale)
    restore_unwritten(data, r.index.inodes, r.index.prealloc)
    orphans = r.index.orphans()
    if orphans:
        freed = [e for ino in orphans for e in namespace.free_if_unused(r.index.inodes[ino])]
        changes.commit(freed, freeing=orphans)
        log.info("reclaimed %d orphan inodes", len(orphans))


def erase_stale(buf: memoryview, changes: ChangeTracker, offset: int, length: int) -> None:
    """Zero the intact records a crash left past the log's tail (a point that never ended:
    fs/log.py scan) before anything is appended there: the records written next take the
    same numbers, and one of those left could otherwise pass for the next one written at
    its place. Replicas get the zeros with the next point."""
    buf[offset: offset + length] = bytes(length)
    changes.persist([(offset, length)])
    log.warning("log: a crash tore the store of a point that never ended; dropped its "
                "records (%d bytes at pool offset %d): none was acknowledged", length, offset)


def restore_unwritten(data: Data, inodes: dict[int, Inode], prealloc: dict[int, set[int]]) -> None:
    """After replay: the blocks logged as preallocated that still read as zeros are
    unwritten again (holes to SEEK_DATA). Writes log no change of that state, so a block
    written since must be told by its bytes: a hole is never reported where data reads
    back. Past PREALLOC_CHECK blocks to read, none is taken (they are data: also safe)."""
    total = sum(len(fbs) for fbs in prealloc.values())
    if not total:
        return
    if total > PREALLOC_CHECK:
        log.info("%d preallocated blocks: reported as data until written or punched", total)
        return
    zero = bytes(BLOCK)
    for ino, fbs in prealloc.items():
        node = inodes.get(ino)
        if node is None:
            continue
        keep = set()
        for fb in fbs:
            pb = node.blocks.get(fb)
            if pb is not None:
                a = data.data_off + (pb << BLOCK_SHIFT)
                if data.buf[a: a + BLOCK] == zero:
                    keep.add(fb)
        if keep:
            data.unwritten[ino] = keep
