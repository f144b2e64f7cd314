"""The things being compared, each brought up under one work directory.

All of them live on the filesystem of the work directory, so the pool files, the
pass-throughs' source trees and the plain directory share the same backing store.
Every context manager leaves nothing mounted behind, also when it fails half-way.

Why two of each FUSE filesystem: before every write(2) to a FUSE filesystem that
implements getxattr, the kernel asks it for "security.capability" (FUSE clears
SB_NOSEC), unless FUSE_HANDLE_KILLPRIV_V2 was negotiated. A filesystem that answers
ENOSYS once is never asked again. rpmemfs negotiates HANDLE_KILLPRIV_V2 through its
patched binding, so with xattrs it gets the requests of the pass-through without them;
the stock pass-through with xattrs pays the extra GETXATTR (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from rpmemfs.tools.processes import (
    MountProcess,
    SpawnError,
    TargetProcess,
    python_module,
    run_rpmemfs,
)

RPMEMFS = "rpmemfs"
RPMEMFS_NOXATTR = "rpmemfs-noxattr"
RPMEMFS_WBCACHE = "rpmemfs-wbcache"
RPMEMFS_NOPOLL = "rpmemfs-nopoll"
PASSTHROUGH = "passthrough"
PASSTHROUGH_XATTR = "passthrough-xattr"
PLAIN = "plain"
RPMEMFS_1REP = "rpmemfs-1rep"
RPMEMFS_2REP = "rpmemfs-2rep"
RPMEMFS_2REP_ASYNC = "rpmemfs-2rep-async"
RPMEMFS_1REP_PLAIN = "rpmemfs-1rep-plain"

# Every target, in the order columns are printed.
TARGET_NAMES = (RPMEMFS, RPMEMFS_1REP, RPMEMFS_1REP_PLAIN, RPMEMFS_2REP, RPMEMFS_2REP_ASYNC, RPMEMFS_NOXATTR,
                RPMEMFS_NOPOLL, RPMEMFS_WBCACHE, PASSTHROUGH, PASSTHROUGH_XATTR, PLAIN)
# The writeback cache changes what a write means (it returns before the daemon sees
# the data), so it is not part of the like-for-like comparison and runs on request; so does
# rpmemfs-nopoll, which shows what polling /dev/fuse after each request is worth.
DEFAULT_TARGETS = (RPMEMFS, RPMEMFS_NOXATTR, PASSTHROUGH, PASSTHROUGH_XATTR, PLAIN)
# What `--replicas` selects: the cost of replication, 0, 1 and 2 replicas. The replicated
# targets start their own target daemons on loopback, so they run only when named.
REPLICA_TARGETS = (RPMEMFS, RPMEMFS_1REP, RPMEMFS_2REP)
# What `--async` selects: 2 replicas with replication=async beside sync and 0 replicas.
ASYNC_TARGETS = (RPMEMFS, RPMEMFS_2REP, RPMEMFS_2REP_ASYNC)
# What `--protection` selects: one replica with its traffic protected (the default) and the
# same in plaintext (--wire-protection none on both ends), in one run.
PROTECTION_TARGETS = (RPMEMFS_1REP, RPMEMFS_1REP_PLAIN)
# Replicated targets whose both ends run with wire protection none.
PLAINTEXT = {RPMEMFS_1REP_PLAIN}

# The target daemons of a replicated target, in order: (--pmem, --persist) each, None
# meaning the daemon's default. The first replica is an appliance-style target (apm: a
# barrier's flush is an 8-byte read), the second a general-purpose one (gpspm: the flush
# is a SEND of the range list, persisted by the target).
REPLICA_DAEMONS: dict[str, tuple[tuple[str | None, str | None], ...]] = {
    RPMEMFS_1REP: (("force", "apm"),),
    RPMEMFS_1REP_PLAIN: (("force", "apm"),),
    RPMEMFS_2REP: (("force", "apm"), (None, None)),
    RPMEMFS_2REP_ASYNC: (("force", "apm"), (None, None)),
}

RPMEMFS_OPTIONS = {
    RPMEMFS: "pmem=force",
    RPMEMFS_NOXATTR: "pmem=force,noxattr",
    RPMEMFS_WBCACHE: "pmem=force,writeback_cache",
    RPMEMFS_NOPOLL: "pmem=force,noxattr,poll_us=0",
    RPMEMFS_1REP: "pmem=force",
    RPMEMFS_1REP_PLAIN: "pmem=force,wire_protection=none",
    RPMEMFS_2REP: "pmem=force",
    RPMEMFS_2REP_ASYNC: "pmem=force,replication=async",
}

TARGET_SUMMARIES = {
    RPMEMFS: f"rpmemfs mount -o {RPMEMFS_OPTIONS[RPMEMFS]} (xattrs supported)",
    RPMEMFS_NOXATTR: f"rpmemfs mount -o {RPMEMFS_OPTIONS[RPMEMFS_NOXATTR]} "
                     "(xattr calls answer ENOSYS)",
    RPMEMFS_WBCACHE: f"rpmemfs mount -o {RPMEMFS_OPTIONS[RPMEMFS_WBCACHE]} "
                     "(kernel writeback cache on)",
    RPMEMFS_NOPOLL: f"rpmemfs mount -o {RPMEMFS_OPTIONS[RPMEMFS_NOPOLL]} "
                    "(no polling of /dev/fuse after requests)",
    PASSTHROUGH: "minimal pyfuse3 pass-through (xattr calls answer ENOSYS)",
    PASSTHROUGH_XATTR: "the same pass-through with xattr calls passed to the source files",
    PLAIN: "the backing directory itself, no FUSE",
    RPMEMFS_1REP: "rpmemfs -o pmem=force with 1 replica: a target daemon on loopback "
                  "(--pmem force --persist apm)",
    RPMEMFS_1REP_PLAIN: "rpmemfs-1rep with its replica traffic in plaintext (target "
                        "--wire-protection none, mount -o wire_protection=none)",
    RPMEMFS_2REP: "rpmemfs -o pmem=force with 2 replicas: target daemons on loopback, "
                  "one --pmem force --persist apm, one default (gpspm)",
    RPMEMFS_2REP_ASYNC: "rpmemfs-2rep with -o replication=async (fsync local, the replicas "
                        "following within the default max_lag)",
}

MOUNT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Target:
    path: Path
    # The daemon's stdout+stderr, quoted when something fails on this target.
    log: Path | None = None
    # The processes that serve path, by role ("daemon", "target0", ...): concurrent_fsync
    # says how much of an operation's CPU time each role took.
    processes: Mapping[str, int] = field(default_factory=dict)


TargetFactory = Callable[[Path, str], AbstractContextManager[Target]]


def mkfs(pool: Path, size: str, replicas: tuple[str, ...] = (), plaintext: bool = False) -> None:
    run_rpmemfs("mkfs", pool, "--size", size, *(arg for spec in replicas for arg in ("--replica", spec)),
                *(("--wire-protection", "none") if plaintext else ()))


@contextmanager
def _daemon(daemon: MountProcess) -> Iterator[MountProcess]:
    """The daemon, its filesystem mounted until the block ends (also when it fails)."""
    daemon.start(MOUNT_TIMEOUT)
    try:
        yield daemon
    finally:
        daemon.stop()


def rpmemfs_daemon(pool: Path, mountpoint: Path, log: Path,
                   options: str = RPMEMFS_OPTIONS[RPMEMFS]) -> AbstractContextManager[MountProcess]:
    """rpmemfs mounted in the foreground (-f), so we own the daemon's lifetime."""
    return _daemon(MountProcess.rpmemfs(pool, mountpoint, options, log_path=log))


@contextmanager
def rpmemfs_target(name: str, workdir: Path, pool_size: str) -> Iterator[Target]:
    # A pool per variant: sharing one would let one target's allocations and log
    # state leak into another's numbers.
    pool = workdir / f"{name}.pool"
    log = workdir / f"{name}.log"
    mkfs(pool, pool_size)
    with rpmemfs_daemon(pool, workdir / f"mnt-{name}", log, RPMEMFS_OPTIONS[name]) as daemon:
        yield Target(daemon.mountpoint, log, {"daemon": daemon.pid})


@contextmanager
def replicated_target(name: str, workdir: Path, pool_size: str) -> Iterator[Target]:
    """rpmemfs with its replicas on target daemons of its own, all on loopback.

    The daemons' pool directories sit in the work directory, so the replica pools share
    the backing store with everything else. They are stopped (SIGTERM, then SIGKILL)
    after the filesystem is unmounted, also when bringing it up fails half-way.
    """
    pool = workdir / f"{name}.pool"
    log = workdir / f"{name}.log"
    with ExitStack() as stack:
        specs: list[str] = []
        pids: dict[str, int] = {}
        for i, (pmem, persist) in enumerate(REPLICA_DAEMONS[name]):
            pool_dir = workdir / f"{name}-target{i}"
            pool_dir.mkdir()
            daemon = TargetProcess(pool_dir, pmem=pmem, persist=persist,
                                   extra=("--wire-protection", "none") if name in PLAINTEXT else (),
                                   log_path=workdir / f"{name}-target{i}.log")
            stack.callback(daemon.close)
            stack.callback(daemon.stop)
            try:
                address = daemon.start()
            except SpawnError as exc:
                raise SpawnError(f"{name}: target daemon {i} did not start: {exc}") from None
            specs.append(f"{address}/{name}-r{i}")
            pids[f"target{i}"] = daemon.pid
        mkfs(pool, pool_size, tuple(specs), plaintext=name in PLAINTEXT)
        with rpmemfs_daemon(pool, workdir / f"mnt-{name}", log,
                            RPMEMFS_OPTIONS[name]) as mount:
            yield Target(mount.mountpoint, log, {"daemon": mount.pid, **pids})


@contextmanager
def passthrough_target(name: str, workdir: Path, pool_size: str) -> Iterator[Target]:
    # A sibling of the pool files, so all sit on the same backing filesystem.
    source = workdir / f"{name}-src"
    source.mkdir()
    mountpoint = workdir / f"mnt-{name}"
    log = workdir / f"{name}.log"
    extra = ["--xattr"] if name == PASSTHROUGH_XATTR else []
    argv = python_module("rpmemfs.tools.bench.passthrough", *extra, source, mountpoint)
    with _daemon(MountProcess(argv, mountpoint, log_path=log, what=name)) as daemon:
        yield Target(daemon.mountpoint, log, {"daemon": daemon.pid})


@contextmanager
def plain_target(workdir: Path, pool_size: str) -> Iterator[Target]:
    directory = workdir / PLAIN
    directory.mkdir()
    yield Target(directory)


TARGETS: dict[str, TargetFactory] = {
    RPMEMFS: partial(rpmemfs_target, RPMEMFS),
    RPMEMFS_NOXATTR: partial(rpmemfs_target, RPMEMFS_NOXATTR),
    RPMEMFS_WBCACHE: partial(rpmemfs_target, RPMEMFS_WBCACHE),
    RPMEMFS_NOPOLL: partial(rpmemfs_target, RPMEMFS_NOPOLL),
    PASSTHROUGH: partial(passthrough_target, PASSTHROUGH),
    PASSTHROUGH_XATTR: partial(passthrough_target, PASSTHROUGH_XATTR),
    PLAIN: plain_target,
    RPMEMFS_1REP: partial(replicated_target, RPMEMFS_1REP),
    RPMEMFS_1REP_PLAIN: partial(replicated_target, RPMEMFS_1REP_PLAIN),
    RPMEMFS_2REP: partial(replicated_target, RPMEMFS_2REP),
    RPMEMFS_2REP_ASYNC: partial(replicated_target, RPMEMFS_2REP_ASYNC),
}
