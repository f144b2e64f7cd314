"""A durability point's ranges are all a replica needs: applying them, in order, to a copy of
the pool gives a pool that mounts with the same tree, through checkpoints and block reuse."""

from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path

import trio

from rpmemfs.durability import Durability
from rpmemfs.fs.check import check
from rpmemfs.fs.filesystem import Filesystem, FsError, NeedSync
from rpmemfs.fs.mkfs import mkfs
from rpmemfs.fs.replay import ROOT_INO
from rpmemfs.pmem import PoolMapping


def _tree(fs: Filesystem, ino: int = ROOT_INO, prefix: str = "") -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for name, child in fs.readdir(ino):
        node = fs.inodes[child]
        path = prefix + name.decode()
        if node.is_dir:
            out[path + "/"] = None
            out.update(_tree(fs, child, path + "/"))
        else:
            out[path] = fs.read(child, 0, node.size)
    return out


def _apply(src: memoryview, replica: Path, ranges: list[tuple[int, int]]) -> None:
    fd = os.open(replica, os.O_WRONLY)
    try:
        for off, n in ranges:
            os.pwrite(fd, src[off: off + n], off)
    finally:
        os.close(fd)


def _replica_tree(replica: Path) -> dict[str, bytes | None]:
    with PoolMapping.open(str(replica), "msync", readonly=True) as pm:
        report = check(pm.buf, str(replica))
        assert report["clean"], report["problems"]
        # a read-only mapping cannot be written, and opening only reads it when nothing
        # needs repair; orphans would need a write, so there must be none
        fs = Filesystem.open(pm.buf, pm, repair=False)
        tree = _tree(fs)
        del fs
        return tree


class _Recorder:
    """Stands in for the replica set: what a point posts is applied to the replica file."""

    def __init__(self, src: memoryview, replica: Path) -> None:
        self.lock = trio.Lock()
        self.replicas: list[object] = []
        self.src = src
        self.replica = replica

    def post(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        _apply(self.src, self.replica, ranges)
        return ranges

    async def complete(self, flight: list[tuple[int, int]]) -> None:
        return None


def test_barrier_ranges_rebuild_a_mountable_replica(tmp_path: Path) -> None:
    local = tmp_path / "local.pool"
    replica = tmp_path / "replica.pool"
    mkfs(str(local), 4 << 20)  # the smallest pool: 256 KiB log areas, so checkpoints happen
    shutil.copy(local, replica)
    rng = random.Random(5)
    pm = PoolMapping.open(str(local), "force")
    fs = Filesystem.open(pm.buf, pm)
    durability = Durability(fs, pm, _Recorder(pm.buf, replica))  # type: ignore[arg-type]
    files: dict[str, int] = {}
    for round_ in range(150):
        if round_ in (20, 70, 71):
            fs.checkpoint()  # besides the ones a full log area forces
        for _ in range(rng.randint(1, 8)):
            try:
                _random_op(fs, rng, files, round_)
            except NeedSync:
                pass  # the barrier below frees the blocks
            except FsError as e:
                assert e.errno == errno.ENOSPC
        trio.run(durability.point)
        assert _replica_tree(replica) == _tree(fs), f"round {round_}"
    assert fs.log.checkpoints >= 3
    del fs, durability
    pm.close()


def _random_op(fs: Filesystem, rng: random.Random, files: dict[str, int], round_: int) -> None:
    op = rng.random()
    if op < 0.4 or not files:
        name = f"f{round_}_{rng.randrange(1 << 30)}"
        files[name] = fs.create(ROOT_INO, name.encode(), 0o100644, 0, 0).ino
        fs.write(files[name], 0, rng.randbytes(rng.choice([10, 4096, 9000, 70000])))
    elif op < 0.7:
        name = rng.choice(list(files))
        fs.write(files[name], rng.randrange(50000), rng.randbytes(rng.randrange(1, 20000)))
    elif op < 0.85:
        name = rng.choice(list(files))
        fs.unlink(ROOT_INO, name.encode())
        del files[name]
    else:
        name = rng.choice(list(files))
        fs.setattr(files[name], size=rng.randrange(30000))
