"""A pool holding many small files, built in-process through the Filesystem API.

Creating them through a FUSE mount costs about a millisecond each (300,000 took 4 minutes);
here they cost tens of microseconds, by the same code a mount runs (create, write, a
durability point per directory), so the pool's log is what that mount would have left. For
the mount-time benchmark only: the mounts it times are real.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

from rpmemfs.durability import Durability
from rpmemfs.fs.filesystem import Filesystem
from rpmemfs.pmem import PoolMapping

FILES_PER_DIR = 100


def dir_name(index: int) -> str:
    return f"d{index:04d}"


def file_name(index: int) -> str:
    return f"f{index:03d}"


def populate(pool: Path, n_files: int) -> float:
    """Create ``n_files`` files of a few bytes each (FILES_PER_DIR per directory) in the
    formatted pool at ``pool``; returns the seconds it took. The log is left as a mount
    killed right after its last fsync leaves it: no checkpoint beyond those the log needed
    when it filled."""
    start = time.perf_counter()
    mapping = PoolMapping.open(str(pool), "force", exclusive=True)
    try:
        fs = Filesystem.open(mapping.buf, mapping)
        points = Durability(fs, mapping)
        for d in range((n_files + FILES_PER_DIR - 1) // FILES_PER_DIR):
            directory = fs.mkdir(1, dir_name(d).encode(), stat.S_IFDIR | 0o755, 0, 0).ino
            for i in range(min(FILES_PER_DIR, n_files - d * FILES_PER_DIR)):
                ino = fs.create(directory, file_name(i).encode(), stat.S_IFREG | 0o644, 0, 0).ino
                fs.write(ino, 0, b"%d/%d\n" % (d, i))
            points.sync_local()
        del fs, points  # they hold views of the mapping
    finally:
        mapping.close()
    return time.perf_counter() - start
