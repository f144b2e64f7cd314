"""A pool in memory for the unit tier, and what a crash would leave of it.

``new_pool`` formats a bytearray the way mkfs formats a file (``format_pool``); a
``MemPersister`` stands in for the mapping's persistence: it records every persist call, in
order, as the bytes it made durable. Replaying a prefix of those calls over the pool as it was
formatted gives the media after a power loss at that point, when only what was persisted
survives; ``media`` builds that, optionally with some of the cache lines the program had
stored but not yet persisted (cache eviction writes lines back in any order).

``durable(fs)`` is the one way these tests ask for a durability point, so that a change in how
the filesystem is made durable is adapted here alone.
"""

from __future__ import annotations

import random
import stat
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from rpmemfs.durability import Durability
from rpmemfs.fs.filesystem import Filesystem
from rpmemfs.fs.mkfs import format_pool
from rpmemfs.fs.replay import ROOT_INO
from rpmemfs.pool.layout import Header, plan

POOL_SIZE = 4 << 20  # the smallest pool mkfs makes: 256 KiB log areas, ~3.3 MiB of data
LINE = 64


def durable(fs: Filesystem) -> None:
    """A durability point: every change so far survives a crash once this returns."""
    Durability(fs, fs.persister).sync_local()  # type: ignore[arg-type]  # a MemPersister


@dataclass
class Call:
    """One persist call: the ranges it made durable (their bytes then), and the test's
    operation counter when it ran. Within a call nothing is ordered; calls are."""

    ranges: list[tuple[int, bytes]]
    tag: int


@dataclass
class MemPersister:
    """The Persister of a pool held in ``buf`` (what PoolMapping is to a mapped file)."""

    buf: bytearray
    formatted: bytes = b""
    calls: list[Call] = field(default_factory=list)
    tag: int = 0  # set by a test to tell which operation a call belongs to

    def __post_init__(self) -> None:
        if not self.formatted:
            self.formatted = bytes(self.buf)

    def persist(self, ranges: Iterable[tuple[int, int]]) -> None:
        got: list[tuple[int, bytes]] = []
        for off, n in ranges:
            assert off >= 0 and n >= 0 and off + n <= len(self.buf), (off, n)
            if n:
                got.append((off, bytes(self.buf[off: off + n])))
        if got:
            self.calls.append(Call(got, self.tag))

    def persist_then_store(self, first: Iterable[tuple[int, int]], offset: int, data: bytes,
                           then: tuple[int, bytes] | None = None) -> None:
        self.persist(first)
        for at, part in ((offset, data), *((then,) if then is not None else ())):
            self.buf[at: at + len(part)] = part
            self.persist([(at, len(part))])

    def media(self, upto: int | None = None, *, torn: Iterable[int] = (),
              evict: float = 0.0, rng: random.Random | None = None) -> bytearray:
        """The pool after a crash: the first ``upto`` persist calls (all of them by default)
        over the formatted pool; of call ``upto`` the ranges numbered in ``torn``; and, with
        ``evict`` > 0, that share of the cache lines ``buf`` holds beyond what was persisted."""
        out = bytearray(self.formatted)
        calls = self.calls if upto is None else self.calls[:upto]
        for call in calls:
            for off, data in call.ranges:
                out[off: off + len(data)] = data
        if upto is not None and upto < len(self.calls):
            ranges = self.calls[upto].ranges
            for i in torn:
                off, data = ranges[i]
                out[off: off + len(data)] = data
        if evict:
            rng = rng or random.Random(0)
            for line in differing_lines(out, self.buf):
                if rng.random() < evict:
                    out[line: line + LINE] = self.buf[line: line + LINE]
        return out


def differing_lines(a: bytes | bytearray, b: bytes | bytearray) -> list[int]:
    """Offsets of the cache lines where a and b differ (compared a block at a time first)."""
    out: list[int] = []
    step = 4096
    for base in range(0, len(a), step):
        if a[base: base + step] == b[base: base + step]:
            continue
        out += [off for off in range(base, base + step, LINE) if a[off: off + LINE] != b[off: off + LINE]]
    return out


def new_pool(size: int = POOL_SIZE) -> tuple[bytearray, Header]:
    """A freshly formatted pool: an empty root directory owned by 0:0."""
    hdr = plan(size, uuid.uuid4().bytes, time.time_ns())
    buf = bytearray(size)
    format_pool(memoryview(buf), hdr, 0, 0)
    return buf, hdr


def new_fs(size: int = POOL_SIZE) -> tuple[Filesystem, MemPersister]:
    buf, _ = new_pool(size)
    persister = MemPersister(buf)
    return Filesystem.open(memoryview(buf), persister), persister


def reopen(buf: bytearray) -> tuple[Filesystem, MemPersister]:
    """Mount a copy of ``buf`` (the media after a crash, say), as a restart would."""
    copy = bytearray(buf)
    persister = MemPersister(copy)
    return Filesystem.open(memoryview(copy), persister), persister


# ------------------------------------------------------------------ what a tree holds

FileState = tuple[int, int, int, int, int, int, bytes, tuple[tuple[bytes, bytes], ...]]


def tree(fs: Filesystem) -> dict[str, tuple[int, FileState]]:
    """Every path under the root: (inode number, (type, permissions, uid, gid, nlink, size,
    content or symlink target, xattrs)). Times are left out."""
    out: dict[str, tuple[int, FileState]] = {}

    def walk(ino: int, path: str) -> None:
        node = fs.node(ino)
        if node.is_dir:
            body = b""
        elif stat.S_ISLNK(node.mode):
            body = node.target
        else:
            body = fs.read(ino, 0, node.size)
        xattrs = tuple(sorted(node.xattrs.items()))
        out[path] = (ino, (stat.S_IFMT(node.mode), stat.S_IMODE(node.mode), node.uid, node.gid,
                           node.nlink, node.size, body, xattrs))
        if node.is_dir:
            for name, child in sorted(fs.readdir(ino)):
                walk(child, f"{path}/{name.decode()}")

    walk(ROOT_INO, "")
    return out


def metadata(t: dict[str, tuple[int, FileState]]) -> dict[str, tuple[object, ...]]:
    """A tree without regular files' contents (their size stays)."""
    return {p: (ino, *s[:6], s[6] if stat.S_ISLNK(s[0]) else b"", s[7]) for p, (ino, s) in t.items()}
