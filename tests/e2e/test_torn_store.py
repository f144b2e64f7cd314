"""Power lost inside the store of one durability point's log records (rpmemfs/fs/log.py, scan;
docs/format.md, "Replay"): the point stored several records with one copy, the cache wrote
back some of their lines and not others, and the stamp that says the point ended was not
written yet. The real mount then starts without that point (none of it was acknowledged)
instead of refusing the pool, erases what is left of it, and `rpmemfs check` says so.

A power loss cannot be had on this machine (kill -9 loses no cache line), so the pool file is
made into the image such a crash leaves: the stamp of the point before, and the first record
of the point as it was before its store, from its start to the end of its cache line (the
line the cache did not write back); every other line of the store is there.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import MakePool, MountPool
from helpers import cli, write_fsync

from rpmemfs.fs.log import scan
from rpmemfs.pool import position
from rpmemfs.pool.header import read_header

LINE = 64


def _stamp(pool: Path) -> bytes:
    with open(pool, "rb") as f:
        return os.pread(f.fileno(), position.SIZE, position.POSITION_OFF)


def test_a_torn_store_of_a_point_that_never_ended_mounts_without_that_point(
        make_pool: MakePool, mount_pool: MountPool) -> None:
    pool = make_pool("64M")
    m = mount_pool(pool, options="pmem=force,commit=0")
    write_fsync(m.path / "kept", b"acknowledged")
    before = _stamp(pool)
    ended = position.decode(before)
    assert ended is not None
    # Four files created, then one fsync: one point, several records, one store.
    fds = [os.open(m.path / f"lost-{i}", os.O_CREAT | os.O_WRONLY, 0o644) for i in range(4)]
    os.fsync(fds[0])
    after = position.decode(_stamp(pool))
    assert after is not None and after.seq > ended.seq
    m.kill9()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass  # the daemon is gone

    image = bytearray(pool.read_bytes())
    buf = memoryview(image)
    hdr, _ = read_header(buf)
    found = scan(buf, hdr)
    base = hdr.area_off(found.active)
    first = next(r for r in found.records if r.seq == ended.seq + 1)
    start = base + first.offset
    assert found.records[-1].seq == after.seq and found.records[-1].offset > first.offset
    image[start: (start // LINE + 1) * LINE] = bytes((start // LINE + 1) * LINE - start)
    image[position.POSITION_OFF: position.POSITION_OFF + position.SIZE] = before
    pool.write_bytes(image)

    res = cli("check", pool)
    assert res.returncode == 0 and "never ended" in res.stdout, res.stdout + res.stderr
    m.start()
    assert sorted(os.listdir(m.path)) == ["kept"]
    assert (m.path / "kept").read_bytes() == b"acknowledged"
    assert "dropped its records" in m.output()
    # What the mount writes next takes the dropped records' numbers and places: one file made
    # as each lost one was, under a name as long, is a record of the first one's size; after
    # another crash the dropped record numbered next must not be read as its successor.
    fd = os.open(m.path / "made-0", os.O_CREAT | os.O_WRONLY, 0o644)
    os.fsync(fd)
    m.kill9()
    try:
        os.close(fd)
    except OSError:
        pass
    m.start()
    assert sorted(os.listdir(m.path)) == ["kept", "made-0"]
