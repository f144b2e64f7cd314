"""Durability of the filesystem over a pool in memory: what a power loss leaves, at every point.

The persister records each persist call; the media after a crash is the formatted pool plus
a prefix of those calls (plus, where said, cache lines written back early by eviction). After
every such crash the pool must mount, pass the checker, and hold a state the program went
through no earlier than its last completed durability point: its metadata exactly one of
those states, and every byte of every file what the file held there in one of those states
or a later one (an overwrite in place may land before its fsync; nothing older may show).
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Callable

import pytest
from mempool import MemPersister, durable, metadata, new_fs, reopen, tree

from rpmemfs.fs.check import check
from rpmemfs.fs.filesystem import Filesystem, FsError
from rpmemfs.fs.replay import ROOT_INO
from rpmemfs.pool import position
from rpmemfs.pool.layout import AREA_RECORDS_OFF, BLOCK, PoolFormatError

REG = stat.S_IFREG | 0o644
Tree = dict[str, tuple[int, tuple[int, int, int, int, int, int, bytes, tuple[tuple[bytes, bytes], ...]]]]


def region(fs: Filesystem, off: int) -> str:
    if off < fs.hdr.area_off(0):
        return "header"
    if off < fs.data_off:
        return "log"
    return "data"


# ------------------------------------------------------------------ ordering


def test_data_is_persisted_before_the_log_record_that_points_at_it() -> None:
    fs, p = new_fs()
    ino = fs.create(ROOT_INO, b"f", REG, 0, 0).ino
    fs.write(ino, 0, b"a" * (2 * BLOCK + 5))
    fs.write(ino, 5 * BLOCK, b"b" * 10)
    p.calls.clear()
    durable(fs)
    kinds = [{region(fs, off) for off, _ in c.ranges} for c in p.calls]
    # Data, then the log record, then the stamp that says the point ended (fs/log.py scan).
    assert kinds == [{"data"}, {"log"}, {"header"}], kinds
    (off, raw), = p.calls[2].ranges
    stamp = position.decode(raw)
    assert off == position.POSITION_OFF and stamp is not None and stamp.seq == fs.log.next_seq - 1
    data = p.calls[0].ranges
    node = fs.node(ino)
    for fb in (0, 1, 2, 5):
        a = fs.data_off + node.blocks[fb] * BLOCK
        assert any(off <= a < off + len(d) for off, d in data), f"block {fb} not persisted"
    # Nothing is persisted twice, and a durability point with nothing new persists nothing.
    p.calls.clear()
    durable(fs)
    assert p.calls == []


def test_crash_between_data_and_record_keeps_the_old_state() -> None:
    fs, p = new_fs()
    ino = fs.create(ROOT_INO, b"f", REG, 0, 0).ino
    fs.write(ino, 0, b"old")
    durable(fs)
    synced = len(p.calls)
    fs.write(ino, 0, b"new data that grows the file")
    durable(fs)
    assert len(p.calls) == synced + 3  # the data, then the record, then the stamp
    # Power lost after the data, before the record: the file is as synced (its first three
    # bytes may be new: overwritten in place, which POSIX allows before the fsync returns).
    crashed = reopen(p.media(synced + 1))[0]
    assert crashed.node(ino).size == 3
    assert crashed.read(ino, 0, 3) in (b"old", b"new")
    # After the record: all of it.
    assert reopen(p.media(synced + 2))[0].read(ino, 0, 100) == b"new data that grows the file"


# ------------------------------------------------------------------ random workloads, crashed


class Workload:
    """Random operations on a filesystem, with the state after each one recorded."""

    def __init__(self, seed: int, *, xattrs: int = 2) -> None:
        self.rng = random.Random(seed)
        self.fs, self.p = new_fs()
        self.xattrs = xattrs  # the weight of setxattr: high fills the log fast
        self.checkpoint_ops: list[int] = []  # operations during which the log checkpointed
        self.states: list[Tree] = [tree(self.fs)]
        self.synced: list[bool] = [True]  # the formatted pool is durable
        self.buffers: dict[int, bytearray] = {}  # the pool's bytes after some operations

    def names(self, kind: int | None = None) -> list[tuple[int, bytes, int]]:
        """(parent, name, ino) of every entry, of one type if given."""
        out = []
        for ino, node in self.fs.inodes.items():
            for name, child in (node.children or {}).items():
                if kind is None or stat.S_IFMT(self.fs.inodes[child].mode) == kind:
                    out.append((ino, name, child))
        return sorted(out)

    def dirs(self) -> list[int]:
        return sorted(i for i, n in self.fs.inodes.items() if n.is_dir)

    def step(self) -> None:
        fs, rng = self.fs, self.rng
        self.p.tag = len(self.states)
        files = self.names(stat.S_IFREG)
        ops: list[tuple[int, Callable[[], object]]] = [
            (3, lambda: fs.create(rng.choice(self.dirs()), b"f%d" % rng.randrange(40), REG, 0, 0)),
            (1, lambda: fs.mkdir(rng.choice(self.dirs()), b"d%d" % rng.randrange(8), 0o755, 0, 0)),
            (1, lambda: fs.symlink(rng.choice(self.dirs()), b"s%d" % rng.randrange(8),
                                   os.urandom(rng.randrange(1, 64)), 0, 0)),
            (3, self.durable),
        ]
        if files:
            pick = rng.choice(files)
            size = rng.choice((1, 100, BLOCK, 3 * BLOCK + 17, 5000))
            ops += [
                (6, lambda: fs.write(pick[2], rng.randrange(0, 3 * BLOCK), os.urandom(size))),
                (2, lambda: fs.setattr(pick[2], size=rng.randrange(0, 4 * BLOCK))),
                (2, lambda: fs.unlink(pick[0], pick[1])),
                (1, lambda: fs.link(pick[2], rng.choice(self.dirs()), b"l%d" % rng.randrange(8))),
                (self.xattrs, lambda: fs.setxattr(pick[2], b"user.%d" % rng.randrange(4),
                                                  os.urandom(rng.randrange(0, 2000 * self.xattrs)))),
                (1, lambda: fs.removexattr(pick[2], b"user.%d" % rng.randrange(4))),
                (1, lambda: fs.setattr(pick[2], mode=rng.randrange(0o1000))),
            ]
        entries = self.names()
        if entries:
            src = rng.choice(entries)
            dst_dir = rng.choice(self.dirs())
            dst_name = rng.choice([src[1], b"r%d" % rng.randrange(8)])
            ops += [
                (2, lambda: fs.rename(src[0], src[1], dst_dir, dst_name, rng.choice((0, 0, 1, 2)))),
                (1, lambda: fs.rmdir(src[0], src[1])),
            ]
        op = rng.choices([o for _, o in ops], [w for w, _ in ops])[0]
        is_sync = op == self.durable
        checkpoints = fs.log.checkpoints
        try:
            op()
        except FsError:
            pass  # refused (EEXIST, ENOTEMPTY, ...): changes nothing
        if fs.log.checkpoints != checkpoints:
            self.checkpoint_ops.append(len(self.states))
        self.states.append(tree(fs))
        self.synced.append(is_sync)
        if rng.random() < 0.05:
            self.buffers[len(self.states) - 1] = bytearray(fs.buf)

    def durable(self) -> None:
        durable(self.fs)

    def run(self, n: int) -> None:
        for _ in range(n):
            self.step()

    # ---------------------------------------------------------------- checking a crash

    def check_crash(self, media: bytearray, lo: int, hi: int, what: str) -> None:
        """The media mounts, is clean, and holds state i for some lo <= i <= hi; a file's
        contents may be newer (overwritten in place), byte by byte, but never older."""
        report = check(memoryview(bytes(media)))
        assert not report["problems"], (what, report["problems"])
        got = tree(reopen(media)[0])
        meta = metadata(got)
        found = [i for i in range(lo, hi + 1) if metadata(self.states[i]) == meta]
        assert found, f"{what}: the pool holds no state the program went through in [{lo}, {hi}]"
        for path, (ino, st) in got.items():
            if not stat.S_ISREG(st[0]) or st[6] == self.states[found[0]][path][1][6]:
                continue
            versions = [s[p][1][6] for s in self.states[lo:] for p in s if s[p][0] == ino]
            body = st[6]
            for pos in range(len(body)):
                if all(pos >= len(v) or v[pos] != body[pos] for v in versions):
                    raise AssertionError(f"{what}: {path} byte {pos} = {body[pos]:#x} was never "
                                         f"written there since state {lo}")

    def last_synced(self, before: int) -> int:
        """The last state made durable by an operation that completed before operation ``before``."""
        return max(i for i in range(before) if self.synced[i])


def crash_everywhere(w: Workload, seed: int, only: set[int] | None = None) -> int:
    """Crash before every persist call (of the operations in ``only``, if given) and after the
    last one; returns how many crashes were checked."""
    p: MemPersister = w.p
    n = len(p.calls)
    checked = 0
    for k in range(n + 1):
        # Calls 0..k-1 are on the media; call k (of operation `cur`) is not.
        cur = p.calls[k].tag if k < n else len(w.states)
        if only is not None and cur not in only and k < n:
            continue
        checked += 1
        w.check_crash(p.media(k), w.last_synced(cur), min(cur, len(w.states) - 1),
                      f"seed {seed}, crash before persist call {k} of {n} (operation {cur})")
    return checked


@pytest.mark.parametrize("seed", range(6))
def test_crash_after_any_persist_call_keeps_every_synced_change(seed: int) -> None:
    w = Workload(seed)
    w.run(150)
    assert sum(w.synced) > 5
    assert crash_everywhere(w, seed) > 5


@pytest.mark.parametrize("seed", range(3))
def test_crash_with_evicted_cache_lines_corrupts_nothing_synced(seed: int) -> None:
    """Lines stored but not persisted may reach the media anyway (cache eviction): the state
    is still one the program went through, and synced changes are all there."""
    w = Workload(100 + seed)
    w.run(150)
    crash_with_evictions(w, seed)


def crash_with_evictions(w: Workload, seed: int) -> None:
    """After every operation of a run workload, crash with 10%, half and all of the lines it
    stored but did not persist on the media anyway; each crash checked by the workload."""
    w.buffers[len(w.states) - 1] = bytearray(w.fs.buf)
    rng = random.Random(seed)
    for at, buf in sorted(w.buffers.items()):
        calls = sum(1 for c in w.p.calls if c.tag <= at)
        crash = MemPersister(buf, formatted=w.p.formatted, calls=w.p.calls[:calls])
        for share in (0.1, 0.5, 1.0):
            w.check_crash(crash.media(evict=share, rng=rng), w.last_synced(at + 1), at,
                          f"seed {seed}, crash after operation {at}, {share:.0%} of lines evicted")


def test_checkpoints_when_the_log_fills_and_crashes_during_them() -> None:
    """A log area that fills is replaced by a snapshot in the other area; the switch (the
    snapshot persisted, then the area header) survives a crash at any point."""
    w = Workload(7, xattrs=20)
    gen0 = w.fs.log.gen
    while w.fs.log.checkpoints < 2:
        w.run(20)
        assert len(w.states) < 2000, "the log never filled"
    assert w.fs.log.gen == gen0 + 2
    w.run(5)
    assert crash_everywhere(w, 7, {op + d for op in w.checkpoint_ops for d in (-1, 0, 1)}) > 4
    # The snapshot lands before the header that makes its area the active one.
    for i, call in enumerate(w.p.calls):
        for off, _ in call.ranges:
            if off in (w.fs.hdr.area_off(0), w.fs.hdr.area_off(1)):
                earlier = [o for c in w.p.calls[:i] for o, _ in c.ranges]
                assert off + AREA_RECORDS_OFF in earlier, "area header persisted before its snapshot"
    # And a clean remount sees exactly the state now.
    durable(w.fs)
    assert tree(reopen(bytearray(w.fs.buf))[0]) == tree(w.fs)


def test_power_loss_inside_the_store_of_several_records_keeps_the_synced_state() -> None:
    """Records staged by several operations reach the pool in one store at the durability
    point; power lost before that store is fenced may have written any of its cache lines.
    Intact records after a torn one are then that unfinished point's: the stamp of the last
    point that ended is older than them, so the mount drops them (and erases them, so that
    they never pass for records written later at the same place)."""
    fs, p = new_fs()
    empty = tree(fs)
    for i in range(4):
        fs.create(ROOT_INO, b"file-with-a-long-name-%d" % i, REG, 0, 0)
    durable(fs)
    (off, data), = p.calls[-2].ranges
    assert region(fs, off) == "log" and len(data) > 3 * 64
    # Every line written back but the one holding the first record's header.
    media = p.media(len(p.calls) - 2)
    line = (off // 64 + 1) * 64
    media[line: off + len(data)] = data[line - off:]
    assert any("never ended" in n for n in check(memoryview(bytes(media)))["notes"])
    again, persister = reopen(media)
    assert tree(again) == empty
    assert bytes(again.buf[off: off + len(data)]) == bytes(len(data))
    assert (off, len(data)) in [(o, len(d)) for c in persister.calls for o, d in c.ranges]
    # The mount goes on from there; its next record has the number and the size of the first
    # one dropped, so were the dropped ones still there, the next of them would be replayed
    # after it.
    again.create(ROOT_INO, b"file-with-a-long-name-X", REG, 0, 0)
    durable(again)
    assert set(tree(reopen(bytearray(again.buf))[0])) == set(empty) | {"/file-with-a-long-name-X"}


def test_a_damaged_record_of_a_point_that_ended_makes_the_mount_refuse_the_pool() -> None:
    """The same damage in a record of a point whose stamp was written (acknowledged) is not a
    crash inside a store: dropping it and the records after it would lose acknowledged
    changes, so the mount refuses the pool and says where."""
    fs, p = new_fs()
    fs.create(ROOT_INO, b"first", REG, 0, 0)
    durable(fs)
    (off, _), = p.calls[-2].ranges
    for i in range(3):
        fs.create(ROOT_INO, b"later-%d" % i, REG, 0, 0)
        durable(fs)
    media = bytearray(fs.buf)
    media[off + 16] ^= 0xFF  # inside the first point's record, acknowledged
    with pytest.raises(PoolFormatError, match="intact later records follow"):
        reopen(media)


def test_without_a_stamp_a_damaged_record_with_intact_ones_after_it_is_refused() -> None:
    """A pool last written by a version that stamped no point (or whose stamp is damaged)
    cannot tell a torn store from damage: it is refused, as before."""
    fs, p = new_fs()
    for i in range(4):
        fs.create(ROOT_INO, b"file-with-a-long-name-%d" % i, REG, 0, 0)
    durable(fs)
    (off, data), = p.calls[-2].ranges
    media = p.media(len(p.calls) - 2)
    line = (off // 64 + 1) * 64
    media[line: off + len(data)] = data[line - off:]
    media[position.POSITION_OFF: position.POSITION_OFF + position.SIZE] = bytes(position.SIZE)
    with pytest.raises(PoolFormatError, match="intact later records follow"):
        reopen(media)
