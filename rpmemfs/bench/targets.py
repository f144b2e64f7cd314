"""The three things being compared, each brought up under one work directory.

All of them live on the filesystem of the work directory, so the pool file, the
pass-through's source tree and the plain directory share the same backing store.
Every context manager leaves nothing mounted behind, also when it fails half-way.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from rpmemfs.bench.mounts import (
    MountError,
    child_env,
    python_module,
    stop_daemon,
    wait_until_mounted,
)

TARGET_NAMES = ("rpmemfs", "passthrough", "plain")
MOUNT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Target:
    path: Path
    # The daemon's stdout+stderr, quoted when something fails on this target.
    log: Path | None = None


TargetFactory = Callable[[Path, str], AbstractContextManager[Target]]


def rpmemfs_command(*args: str) -> list[str]:
    return python_module("rpmemfs.cli", *args)


def mkfs(pool: Path, size: str) -> None:
    done = subprocess.run(rpmemfs_command("mkfs", str(pool), "--size", size),
                          capture_output=True, env=child_env(), check=False)
    if done.returncode != 0:
        output = (done.stderr or done.stdout).decode(errors="replace").strip()
        raise MountError(f"rpmemfs mkfs {pool} --size {size} failed "
                         f"(status {done.returncode}):\n  {output}")


@contextmanager
def _daemon(argv: list[str], mountpoint: Path, log: Path, what: str) -> Iterator[Path]:
    mountpoint.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, env=child_env())
    try:
        wait_until_mounted(mountpoint, proc, MOUNT_TIMEOUT, what, log)
        yield mountpoint
    finally:
        stop_daemon(proc, mountpoint)


@contextmanager
def rpmemfs_daemon(pool: Path, mountpoint: Path, log: Path) -> Iterator[Path]:
    """rpmemfs mounted in the foreground (-f), so we own the daemon's lifetime."""
    argv = rpmemfs_command("mount", str(pool), str(mountpoint), "-f", "-o", "pmem=force")
    with _daemon(argv, mountpoint, log, "rpmemfs mount") as mnt:
        yield mnt


@contextmanager
def rpmemfs_target(workdir: Path, pool_size: str) -> Iterator[Target]:
    pool = workdir / "rpmemfs.pool"
    log = workdir / "rpmemfs.log"
    mkfs(pool, pool_size)
    with rpmemfs_daemon(pool, workdir / "mnt-rpmemfs", log) as mnt:
        yield Target(mnt, log)


@contextmanager
def passthrough_target(workdir: Path, pool_size: str) -> Iterator[Target]:
    # A sibling of the pool file, so both sit on the same backing filesystem.
    source = workdir / "passthrough-src"
    source.mkdir()
    mountpoint = workdir / "mnt-passthrough"
    log = workdir / "passthrough.log"
    argv = python_module("rpmemfs.bench.passthrough", str(source), str(mountpoint))
    with _daemon(argv, mountpoint, log, "passthrough") as mnt:
        yield Target(mnt, log)


@contextmanager
def plain_target(workdir: Path, pool_size: str) -> Iterator[Target]:
    directory = workdir / "plain"
    directory.mkdir()
    yield Target(directory)


TARGETS: dict[str, TargetFactory] = {
    "rpmemfs": rpmemfs_target,
    "passthrough": passthrough_target,
    "plain": plain_target,
}

