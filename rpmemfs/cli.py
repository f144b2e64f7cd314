"""The `rpmemfs` command: every command's arguments, and the dispatch to the layer that does it.
`rpmemfs --help` names the commands as the parser holds them (build_parser), never from a list
kept by hand.

This is the CLI edge: argparse dispatches every command (global options such as --log-level
work before or after it), and main() turns what a command raises into what a user sees, once:
an error rpmemfs reports on purpose is one line on stderr and exit status 1, a usage error one
line and status 2, anything else one "internal error" line (its traceback at --log-level debug).
Output into a pipe whose reader has gone is dropped, and the command keeps its exit status.

Why this module is long: it is the one place where every command's arguments are declared and
what a command raises is mapped; each command's body is a few lines handing over to its layer
(a command of its own module would scatter the argument declarations again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO, cast

from rpmemfs import logs
from rpmemfs.cliparse import ArgumentParser
from rpmemfs.errors import RpmemfsError
from rpmemfs.progress import ProgressBar
from rpmemfs.units import human, parse_size

if TYPE_CHECKING:
    from rpmemfs.mountinfo import MountEntry
    from rpmemfs.replica.spec import ReplicaSpec

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "warning"


class CliError(RpmemfsError):
    """A command cannot do what it was asked; the message says why, for the user."""


def _progress(label: str) -> Callable[[int, int], None] | None:
    """A progress callback (done, total) drawing a bar on stderr when it is a terminal."""
    bar = ProgressBar(label)
    return bar.update if bar.shown else None


def _protection(args: argparse.Namespace) -> str:
    """The wire protection a command's connections to targets ask for: its --wire-protection,
    else the default (passed to each layer that connects, never set in the environment)."""
    from rpmemfs.transport.protection import DEFAULT

    return str(args.wire_protection or DEFAULT)


def _token(given: str | None, recorded: str | None = None) -> bytes | None:
    """The token to prove: the token file given, else the one the pool records, else None
    (the user's local token, read when connecting)."""
    from rpmemfs.transport.tokens import TokenError, chosen_token

    try:
        return chosen_token(given, recorded)
    except (TokenError, OSError) as e:
        raise CliError(f"token file {given or recorded}: {e}") from None


def cmd_mkfs(args: argparse.Namespace) -> int:
    from rpmemfs.fs.mkfs import device_at
    from rpmemfs.mountd.errors import ProvisionError
    from rpmemfs.mountd.provision import create_pool
    from rpmemfs.replica.spec import poolset_at

    pool, size, specs = args.pool, args.size, list(args.replica or [])
    try:
        ps = poolset_at(pool)
    except ValueError as e:  # PoolSetError
        raise CliError(str(e)) from None
    if ps is not None:
        if ps.size is None and device_at(ps.path) is None:
            raise CliError(f"pool set {pool}: its part {ps.path} has size AUTO, which means a whole "
                           "device DAX, and it is none: give the pool's size instead")
        if size is not None and ps.size is not None and size != ps.size:
            raise CliError(f"--size of {size} bytes disagrees with the pool set's {ps.size} bytes")
        pool, size, specs = ps.path, size if ps.size is None else ps.size, ps.replicas + specs
    if size is None:
        dev = device_at(pool)  # a device DAX: the pool takes all of it
        if dev is None:
            raise CliError("--size is required (or give a pool-set file, or a device DAX)")
        size = dev.size
    token = _token(args.token_file)
    try:
        hdr = create_pool(pool, size, specs, token=token, token_file=args.token_file,
                          force=args.force, progress=_progress("mkfs"), wire_protection=_protection(args))
    except ProvisionError as e:
        left = "could not be removed again" in str(e)
        raise CliError(f"mkfs of {pool} failed: {e}. The local pool was removed"
                       + ("" if left else ", and so was every replica it made")
                       + "; fix the cause and run mkfs again (no --force needed)") from None
    print(f"created pool {pool}: {human(hdr.pool_size)}, uuid {hdr.uuid_str}, "
          f"{hdr.data_blocks} data blocks, log areas of {human(hdr.area_size)}"
          + "".join(f"\n  replica {s}" for s in specs))
    return 0


def cmd_grow(args: argparse.Namespace) -> int:
    from rpmemfs.admin import GrowError, grow_pool
    from rpmemfs.devdax import is_char_device

    if os.path.isdir(args.pool) or _mounted_from(args.pool):
        raise CliError(f"{args.pool} is mounted (or is a directory): unmount the pool and grow the "
                       "pool file; growing a mounted pool is not supported")
    if not os.path.isfile(args.pool) and not is_char_device(args.pool):
        raise CliError(f"pool {args.pool} does not exist or is not a file (nor a device DAX)")
    try:
        hdr = grow_pool(args.pool, args.size, lambda recorded: _token(args.token_file, recorded),
                        wire_protection=_protection(args))
    except GrowError as e:
        raise CliError(str(e)) from None
    print(f"grew {args.pool} to {human(hdr.pool_size)}: {hdr.data_blocks} data blocks; its replicas "
          "grew too and are compared in full at the next mount")
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from rpmemfs.mountd.start import run

    return run(args.pool, args.mountpoint, args.o or [], args.foreground, args.wire_protection)


def _rpmemfs_mount(mp: str, elsewise: str) -> MountEntry:
    """The mount table's entry of the rpmemfs mount at ``mp``, found without a stat of the
    mount point (that hangs while its daemon is stuck); CliError when there is none
    (``elsewise`` says what to do about another file system's mount)."""
    from rpmemfs.mountd.unmount import kernel_path
    from rpmemfs.mountinfo import mount_at

    point = kernel_path(mp)
    entry = mount_at(point)
    if entry is None:
        raise CliError(f"{mp} is not a mount point")
    if entry.fstype != "fuse.rpmemfs":
        raise CliError(f"{mp} is not an rpmemfs mount (it is {entry.fstype}){elsewise}")
    return entry


def cmd_umount(args: argparse.Namespace) -> int:
    from rpmemfs.mountd import control, unmount

    mp = args.mountpoint
    entry = _rpmemfs_mount(mp, ": umount(8) unmounts it")
    point = entry.mountpoint
    try:
        last = control.unmount(point, args.timeout)
    except TimeoutError:
        raise CliError(f"the rpmemfs daemon of {mp} does not answer (nothing within "
                       f"{args.timeout:g} s); it stays mounted") from None
    except (ConnectionRefusedError, FileNotFoundError) as e:
        if not unmount.connection_lost(point):
            raise CliError(f"no rpmemfs daemon answers for {mp} ({e}); it stays mounted") from None
        # Its daemon is dead (kill -9, a crash): nothing is left to wait for but the mount.
        try:
            unmount.detach(point, entry.source, lazy=False)
        except OSError as e2:
            raise CliError(f"the daemon of {mp} has died, and {mp} cannot be unmounted: "
                           f"{e2.strerror or e2}") from None
        raise CliError(f"the daemon of {mp} had died: {mp} is unmounted now, but its pool was not "
                       "closed clean (the next mount replays its log and compares its replicas "
                       "in full)") from None
    except (OSError, ValueError) as e:
        raise CliError(f"no rpmemfs daemon answers for {mp} ({e}); it stays mounted") from None
    if "closed" not in last:  # refused, busy say: still mounted
        raise CliError(str(last.get("error", f"unexpected answer {last}")))
    if not last["closed"]:
        raise CliError(f"{mp} is unmounted, but its daemon did not say its pool is closed: "
                       f"{last.get('error') or 'it exited without a word (its log says why)'}")
    if not last.get("clean"):
        raise CliError(f"{mp} is unmounted and its daemon has exited, but {last.get('error')}")
    return 0


def _no_daemon(entry: MountEntry, mountpoint: str, e: Exception) -> CliError:
    """What to say when the daemon of the mount ``entry`` did not answer: a dead mount (its
    daemon killed) named, with what takes it away."""
    from rpmemfs.mountd import unmount

    if isinstance(e, (ConnectionRefusedError, FileNotFoundError)) and unmount.connection_lost(
            entry.mountpoint):
        return CliError(f"{unmount.dead_mount(entry)}, and so does mounting the pool there again "
                        "(its log is replayed)")
    return CliError(f"no rpmemfs daemon answers for {mountpoint} ({e})")


def _status(mountpoint: str, timeout: float = 10.0) -> dict[str, Any]:
    from rpmemfs.mountd import control

    entry = _rpmemfs_mount(mountpoint, "")
    try:
        return control.query(entry.mountpoint, timeout=timeout)
    except (OSError, ValueError) as e:
        raise _no_daemon(entry, mountpoint, e) from None


def cmd_status(args: argparse.Namespace) -> int:
    from rpmemfs.mountd.status import Health, format_status, health

    try:
        st = _status(args.mountpoint, args.timeout)
    except CliError as e:
        print(f"rpmemfs: {e}", file=sys.stderr)
        return Health.UNKNOWN
    h, why = health(st)
    if args.json:
        print(json.dumps({**st, "health": h.name.lower()}, indent=2))
    elif h is Health.UNKNOWN:  # an answer with nothing in it but an error
        print(f"rpmemfs: {args.mountpoint}: {why}", file=sys.stderr)
    else:
        print(format_status(st))
    return int(h)


def cmd_replica(args: argparse.Namespace) -> int:
    entry = _rpmemfs_mount(args.mountpoint, ": replicas are added to and removed from a mounted pool")
    words = ["replica", args.action, args.replica] + (["force"] if args.force else [])
    reply = _ask_mount(entry, args.mountpoint, " ".join(words), f"replica {args.action}")
    if args.json:
        print(json.dumps(reply, indent=2))
    elif args.action == "add":
        how = "created" if reply.get("created") else "an existing copy, compared"
        sent = (reply.get("resync") or {}).get("bytes_sent", 0)
        print(f"replica {reply['added']} added ({how}; {human(int(sent))} sent) and in sync")
    else:
        print(f"replica {reply['removed']} removed; replicas now: {', '.join(reply['replicas']) or 'none'}")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    entry = _rpmemfs_mount(args.mountpoint, "")
    reply = _ask_mount(entry, args.mountpoint, "flush", "flush")
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    where = (f"the local pool and {reply['in_sync']} of {reply['replicas']} replicas"
             if reply["replicas"] else "the local pool (no replicas)")
    print(f"flushed {reply['flushed']}: {where}, {reply['seconds'] * 1000:.1f} ms")
    return 0


def _mounted_from(pool: str) -> str | None:
    """The mountpoint where ``pool`` is mounted now, if it is."""
    from rpmemfs.mountinfo import mounted_from

    # The mount daemon names its mounts so (fsname=rpmemfs:POOL).
    return mounted_from("rpmemfs:" + os.path.abspath(pool))


def _mount_asked(path: str) -> MountEntry | None:
    """The rpmemfs mount at ``path``, for verify and sync, which take a mount point or a pool
    file; None for a pool file. Found in the mount table, not by a stat: that fails on a
    dead mount (ENOTCONN) and hangs on a stuck one."""
    from rpmemfs.mountd.unmount import kernel_path
    from rpmemfs.mountinfo import mount_at

    entry = mount_at(kernel_path(path))
    if entry is None or entry.fstype == "fuse.rpmemfs":
        return entry
    return _rpmemfs_mount(path, "") if os.path.isdir(path) else None  # says what it is


def _ask_mount(entry: MountEntry, mountpoint: str, request: str, label: str) -> dict[str, Any]:
    """A long request to the daemon of the mount ``entry``, with a progress bar from its
    progress lines."""
    from rpmemfs.mountd import control

    show = _progress(label)
    try:
        reply = control.query(entry.mountpoint, request, timeout=None, progress=show)
    except (OSError, ValueError) as e:
        raise _no_daemon(entry, mountpoint, e) from None
    if "error" in reply and len(reply) == 1:
        raise CliError(str(reply["error"]))
    return reply


def _unmounted_pool(path: str, what: str) -> tuple[str, list[Any] | None]:
    """(pool file, replicas from a pool-set file or None) for a command on an unmounted pool."""
    from rpmemfs.devdax import is_char_device
    from rpmemfs.replica.spec import poolset_at

    pool, specs = path, None
    ps = poolset_at(pool)
    if ps is not None:
        pool, specs = ps.path, ps.replicas
    if not os.path.isfile(pool) and not is_char_device(pool):  # a device DAX is checked as mapped
        raise CliError(f"{path} is neither a pool file nor a mount point")
    where = _mounted_from(pool)
    if where:
        raise CliError(f"pool {pool} is mounted at {where}: {what} the mount point instead "
                       f"(rpmemfs {what} {where})")
    return pool, specs


@contextlib.contextmanager
def _replicated_pool(path: str, token_file: str | None, what: str, writable: bool
                     ) -> Iterator[tuple[str, Any, list[Any], bytes | None]]:
    """(pool file, its mapping, its replicas, the token) of an unmounted pool, for verify and
    sync; the mapping is closed afterwards."""
    from rpmemfs.pmem import PoolMapping
    from rpmemfs.replica.table import inspect_table

    pool, specs = _unmounted_pool(path, what)
    pm = PoolMapping.open(pool, "msync", readonly=not writable, exclusive=writable)
    try:
        table = inspect_table(pm.buf)
        specs = specs if specs is not None else table.replicas
        if not specs:
            raise CliError(f"pool {pool} has no replicas to {what}")
        yield pool, pm, specs, _token(token_file, table.token_file)
    finally:
        try:
            pm.close()
        except BufferError:
            pass  # a view is still referenced; the process exits and unmaps anyway


def cmd_verify(args: argparse.Namespace) -> int:
    import trio

    from rpmemfs.admin import format_report, verify
    from rpmemfs.replica.verify import content_size, report_from_dict

    chunk = args.chunk  # None: the pool's own, which sync counts in too
    if (entry := _mount_asked(args.pool)) is not None:
        request = "verify" if chunk is None else f"verify {chunk}"
        report = report_from_dict(_ask_mount(entry, args.pool, request, "verify"))
    else:
        opened = _replicated_pool(args.pool, args.token_file, "verify", writable=False)
        with opened as (pool, pm, specs, token):
            bar = ProgressBar("verify", content_size(pm.buf) * len(specs))
            try:
                report = trio.run(lambda: verify(pool, pm.buf, specs, token, chunk, bar,
                                                 wire_protection=_protection(args)))
            finally:
                bar.close()
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.clean else 1


def cmd_sync(args: argparse.Namespace) -> int:
    import trio

    from rpmemfs.admin import format_sync, sync_pool
    from rpmemfs.replica.verify import content_size

    if (entry := _mount_asked(args.pool)) is not None:
        result = _ask_mount(entry, args.pool, "sync", "sync")
    else:
        opened = _replicated_pool(args.pool, args.token_file, "sync", writable=True)
        with opened as (pool, pm, specs, token):
            bar = ProgressBar("sync", content_size(pm.buf) * len(specs))
            try:
                result = trio.run(lambda: sync_pool(pool, pm, specs, token, bar,
                                                    wire_protection=_protection(args))).as_dict()
            finally:
                bar.close()
    print(json.dumps(result, indent=2) if args.json else format_sync(result))
    return 0 if result.get("clean") else 1


def _from_replica(args: argparse.Namespace, doing: str) -> tuple[ReplicaSpec, bytes | None]:
    """The --from replica of recover and promote, and the token, once the pool is known not
    to be mounted."""
    if _mounted_from(args.pool):
        raise CliError(f"pool {args.pool} is mounted; unmount it before {doing}")
    return args.source, _token(args.token_file)


def cmd_recover(args: argparse.Namespace) -> int:
    import trio

    from rpmemfs.admin import recover_pool

    source, token = _from_replica(args, "replacing it")
    result = trio.run(lambda: recover_pool(args.pool, source, token, force=args.force,
                                           unfinished_resync=args.unfinished_resync,
                                           progress=_progress("recover"),
                                           wire_protection=_protection(args)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"recovered {result['pool']} from {result['from']}: {result['bytes']} bytes, "
              f"{result['chunks_verified']} chunks verified by checksum, {result['seconds']:.2f} s")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    import trio

    from rpmemfs.admin import promote_pool

    source, token = _from_replica(args, "promoting onto it")
    result = trio.run(lambda: promote_pool(args.pool, source, token, force=args.force,
                                           unfinished_resync=args.unfinished_resync,
                                           progress=_progress("promote"),
                                           wire_protection=_protection(args)))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"promoted {result['pool']} from {result['from']} at epoch {result['epoch']}")
    print(f"  replicas: {', '.join(result['replicas'])}")
    print(f"  claimed (the old primary is fenced there): {', '.join(result['claimed'])}")
    for spec, why in result["unreachable"].items():
        print(f"  NOT REACHED: {spec}: {why}; it is fenced the first time the new primary reaches it")
    print(f"  copied {result['bytes_copied']} bytes ({result['chunks_differing']} chunks differed), "
          f"{result['chunks_compared']} chunks verified by checksum, {result['seconds']:.2f} s")
    b = result.get("behind")
    if b is not None and b["records"] == 0:
        print("  the source held the latest point of every replica reached")
    elif b is not None and b["records"] is not None:
        # Sync mode stamps its points too (for crash recovery): a replica ahead there holds
        # the point in flight when the primary died, which min_replicas=all never acknowledged.
        print(f"  the source was {b['records']} log records ({b['seconds']:.3f} s of the old primary's "
              f"history) behind {b['most_advanced']}, the most advanced replica reached: those "
              "changes are lost (acknowledged ones only with replication=async, or min_replicas "
              "below the number of replicas)")
    print(f"  next: rpmemfs mount {result['pool']} MOUNTPOINT")
    return 0


def _ask_target(args: argparse.Namespace, request: dict[str, object]) -> dict[str, Any]:
    import trio

    from rpmemfs.target.admin import ask

    try:
        return trio.run(ask, args.address, _token(args.token_file), request, args.timeout,
                        _protection(args))
    except ValueError as e:
        raise CliError(f"{args.address}: {e}") from None


def cmd_pools(args: argparse.Namespace) -> int:
    """Exit status for scripts, as `rpmemfs status`'s: 0 every pool is a consistent copy, 1
    some pool's resync began and did not end (UNFINISHED: not a copy to fail over to), 3 the
    target does not answer (or refuses the token)."""
    from rpmemfs.target.admin import format_pools
    from rpmemfs.transport.control_ops import ControlOp, build_request

    try:
        reply = _ask_target(args, build_request(ControlOp.POOLS, {}))
    except (RpmemfsError, OSError) as exc:
        sys.stderr.write(f"rpmemfs: {exc}\n")
        return 3
    pools = reply.get("pools", {})
    print(json.dumps(pools, indent=2) if args.json
          else format_pools(args.address, pools, reply.get("quotas") or {}))
    return 1 if any((p.get("owner") or {}).get("resync") for p in pools.values()) else 0


def cmd_token(args: argparse.Namespace) -> int:
    from rpmemfs.transport.tokens import GENERATED_BYTES, new_token_file

    try:
        new_token_file(args.file)
    except FileExistsError:
        raise CliError(f"{args.file} exists; not replacing a token someone may hold") from None
    print(f"made {args.file}: a {8 * GENERATED_BYTES}-bit token, readable by you alone; give it to "
          "the target (--token-file) and to whoever mounts from it (token_file=, --token-file)")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    from rpmemfs.transport.control_ops import ControlOp, build_request

    reply = _ask_target(args, build_request(ControlOp.EVICT, {"name": args.name}))
    print(f"evicted the writing session of {args.name} on {args.address} (peer {reply.get('evicted')})")
    return 0


def _pool_to_check(path: str) -> str:
    """The pool file that ``path`` (a pool file, a pool-set file) names for check; CliError
    saying what else it is."""
    from rpmemfs.devdax import is_char_device
    from rpmemfs.mountd.unmount import connection_lost, dead_mount, kernel_path
    from rpmemfs.mountinfo import mount_at
    from rpmemfs.replica.spec import poolset_at

    entry = mount_at(kernel_path(path))  # before any stat: that hangs on a stuck mount
    if entry is not None and entry.fstype == "fuse.rpmemfs":
        mp, pool = entry.mountpoint, entry.source.removeprefix("rpmemfs:")
        if connection_lost(mp):
            raise CliError(f"{dead_mount(entry)}; nothing has its pool open: `rpmemfs check "
                           f"{pool}` checks it")
        raise CliError(f"{mp} is a mount point (of pool {pool}): check reads a pool file while "
                       f"nothing has it open; run `rpmemfs verify {mp}` to compare the mounted "
                       f"pool with its replicas, or `rpmemfs umount {mp}` and then "
                       f"`rpmemfs check {pool}`")
    try:
        ps = poolset_at(path)
    except ValueError as e:  # PoolSetError
        raise CliError(str(e)) from None
    pool = ps.path if ps is not None else path
    if not os.path.lexists(pool):
        raise CliError(f"pool {pool} does not exist")
    if os.path.isdir(pool):
        raise CliError(f"{pool} is a directory, not a pool file (nor a pool-set file, nor an "
                       "rpmemfs mount point)")
    if not os.path.isfile(pool) and not is_char_device(pool):  # a device DAX is checked as mapped
        raise CliError(f"{pool} is not a regular file: check reads a pool file, a device DAX or a "
                       "pool-set file")
    return pool


def _refuse_if_open(pool: str, fd: int) -> None:
    """Take a shared lock on the pool open at ``fd``, or raise CliError naming who has it open.
    Every writer holds the exclusive one (pmem.PoolMapping.open): a pool being written is no
    consistent image, where a record stored half reads as damage that is not there. The lock
    stays while ``fd`` is open, so nothing starts writing the pool meanwhile."""
    import fcntl

    from rpmemfs.holders import describe_process, lock_holders, rpmemfs_command
    from rpmemfs.mountd.control import listener_pid
    from rpmemfs.mountinfo import mounts

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    holders = lock_holders(fd)
    why = "check reads a pool only while no process has it open"
    real = os.path.realpath(pool)
    for e in mounts():
        ours = e.fstype == "fuse.rpmemfs" and os.path.realpath(e.source[len("rpmemfs:"):]) == real
        if ours and (pid := listener_pid(e.mountpoint)) in holders:
            mp = e.mountpoint
            raise CliError(f"pool {pool} is mounted at {mp} (its daemon is pid {pid}): {why}; run "
                           f"`rpmemfs verify {mp}` to compare the mounted pool with its replicas, "
                           f"or `rpmemfs umount {mp}` and then check")
    for pid in holders:
        if rpmemfs_command(pid) == "target":
            raise CliError(f"pool {pool} is open in the target daemon {describe_process(pid)}, "
                           f"which serves it as a replica to a mount: {why}; check it once that "
                           "mount is unmounted (the target closes it then)")
    who = "; ".join(map(describe_process, holders)) or "not visible from here"
    raise CliError(f"pool {pool} is open in another process ({who}): {why}; check it once that "
                   "process has ended")


def cmd_check(args: argparse.Namespace) -> int:
    from rpmemfs.fs.check import check, format_report
    from rpmemfs.pmem import PoolMapping

    pool = _pool_to_check(args.pool)
    try:
        fd = os.open(pool, os.O_RDONLY)
    except OSError as e:
        raise CliError(f"cannot open pool {pool}: {e.strerror}") from None
    try:
        _refuse_if_open(pool, fd)
        pm = PoolMapping.open(pool, "msync", readonly=True, opener=lambda _path, _flags: os.dup(fd))
        try:
            report = check(pm.buf, pool)
        finally:
            pm.close()
    finally:
        os.close(fd)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["clean"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from rpmemfs.tools import bench

    return bench.main(args.rest)


def cmd_soak(args: argparse.Namespace) -> int:
    from rpmemfs.tools import soak

    return soak.main(args.rest)


def cmd_timeline(args: argparse.Namespace) -> int:
    from rpmemfs.tools import timeline

    return timeline.main(args.rest)


def cmd_target(args: argparse.Namespace) -> int:
    from rpmemfs.target.cli import build_parser
    from rpmemfs.target.cli import main as target_main

    rest = list(args.rest)
    if args.log_level is not None:
        # Taken out as a global option wherever it stood; the daemon sets up its own logging.
        rest += ["--log-level", args.log_level]
    if args.wire_protection is not None:
        rest += ["--wire-protection", args.wire_protection]
    # The daemon's own parser prints its whole usage before an error; a copy of it built from
    # this module's class checks the options first, so a mistake is one line here too.
    own = build_parser()
    ArgumentParser(prog=own.prog, description=own.description, add_help=False,
                   parents=[own]).parse_args(rest)
    return target_main(rest)


def cmd_ha(args: argparse.Namespace) -> int:
    from rpmemfs.ha.agent import main as agent

    return agent(args.action)


def cmd_demo(args: argparse.Namespace) -> int:
    from rpmemfs.tools.demo import run_demo

    return run_demo(args.dir, args.size)


class _Command(ArgumentParser):
    """A command's parser. With ``own_options`` the command parses its options itself
    (target, bench, soak): this parser takes the global options wherever they stand and
    hands everything else on, in order, as ``rest``."""

    def __init__(self, *args: Any, own_options: bool = False, **kwargs: Any) -> None:
        if own_options:
            # Its --help is the command's; "--log" must not pass for --log-level.
            kwargs.update(add_help=False, allow_abbrev=False)
        super().__init__(*args, **kwargs)
        self.own_options = own_options
        # The epilog, made only when help is shown: mount's lists the mount options, whose
        # module imports most of the daemon (half a second that every command paid).
        self.epilog_from: Callable[[], str] | None = None

    def format_help(self) -> str:
        if self.epilog_from is not None:
            self.epilog, self.epilog_from = self.epilog_from(), None
        return super().format_help()

    # Any: as general as argparse's overloads of it, which a subparser is called through.
    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None
                         ) -> tuple[Any, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        if self.own_options:
            parsed.rest, rest = rest, []
        return parsed, rest


def _global_options(p: argparse.ArgumentParser, top: bool) -> None:
    # After the command they must not reset what was given before it: no default there.
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                   default=None if top else argparse.SUPPRESS,
                   help=f"{', '.join(LOG_LEVELS)} (default {DEFAULT_LOG_LEVEL}); "
                        "before or after the command")
    p.add_argument("--wire-protection", choices=("aead", "none"),
                   default=None if top else argparse.SUPPRESS,
                   help="aead (default): traffic to targets over TCP is encrypted and "
                        "authenticated; none: plaintext, for a trusted link to targets started "
                        "with --wire-protection none (docs/wire.md)")


def _unfinished_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--unfinished-resync", action="store_true",
                   help="take the source even though its target says a resync of it was cut "
                        "short (its content mixes two points in time)")


# Argument types: a value that cannot be right is a usage error (status 2), said by argparse in
# one line naming the option as written ("argument --timeout: ...").


def _replica_arg(text: str) -> ReplicaSpec:
    from rpmemfs.replica.spec import ReplicaSpec

    try:
        return ReplicaSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _replica_text(text: str) -> str:
    """A replica for a mount's daemon, checked here and sent as written."""
    _replica_arg(text)
    return text


def _target_arg(text: str) -> str:
    from rpmemfs.target.admin import plain_address
    from rpmemfs.transport.address import parse_address

    try:
        if parse_address(plain_address(text))[1] == 0:
            raise ValueError(f"bad address {text!r}: port 0 is not a target's port")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _chunk_arg(text: str) -> int:
    chunk = _size_arg(text)
    if chunk < 4096 or chunk % 4096 or chunk > 64 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is not a multiple of 4K, at most 64M")
    return chunk


def _seconds_arg(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return seconds


def options_help() -> str:
    from rpmemfs.mountd.options import options_help

    return options_help()


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="rpmemfs", formatter_class=argparse.RawDescriptionHelpFormatter)
    _global_options(p, top=True)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                           parser_class=_Command)

    def command(name: str, func: Callable[[argparse.Namespace], int], help: str,
                own_options: bool = False) -> argparse.ArgumentParser:
        s: argparse.ArgumentParser = sub.add_parser(name, help=help, own_options=own_options)
        _global_options(s, top=False)
        s.set_defaults(func=func)
        return s

    s = command("mkfs", cmd_mkfs, "make a pool file")
    s.add_argument("pool")
    s.add_argument("--size", type=_size_arg,
                   help="pool size, e.g. 64M, 4G (a pool-set file gives its own)")
    s.add_argument("--force", action="store_true",
                   help="replace an existing pool file (not a symbolic link, nor one in use)")
    s.add_argument("--replica", action="append", type=_replica_arg, metavar="HOST:PORT/NAME",
                   help="make a replica pool NAME on the target daemon at HOST:PORT")
    s.add_argument("--token-file", help="shared token for the target daemons")

    s = command("grow", cmd_grow, "grow an unmounted pool and its replicas")
    s.add_argument("pool")
    s.add_argument("--size", type=_size_arg, required=True, help="the new size, e.g. 8G")
    s.add_argument("--token-file", help="token for the targets (default: the one recorded in the pool)")

    s = command("mount", cmd_mount, "mount a pool")
    s.add_argument("pool")
    s.add_argument("mountpoint")
    s.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    s.add_argument("-o", action="append", metavar="OPT[,OPT...]", help="mount options, below")
    s.formatter_class = argparse.RawDescriptionHelpFormatter
    cast(_Command, s).epilog_from = options_help

    s = command("umount", cmd_umount, "unmount, and return once the daemon has closed the pool "
                "and exited")
    s.add_argument("mountpoint")
    s.add_argument("--timeout", type=_seconds_arg, default=60.0, metavar="SECONDS",
                   help="how long the daemon may take to answer (default 60); closing the pool "
                        "afterwards is bounded by the replicas' timeout instead")

    s = command("status", cmd_status, "show a mount's state; exit status 0 healthy, 1 degraded "
                "(not every replica in sync), 2 failing (fsync returns EIO), 3 unknown")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.add_argument("--timeout", type=_seconds_arg, default=10.0,
                   help="seconds to wait for the daemon (default 10)")

    s = command("replica", cmd_replica, "add a replica to a mounted pool (it is created or compared, "
                "resynced, and joins when in sync) or remove one")
    s.add_argument("action", choices=("add", "remove"))
    s.add_argument("mountpoint")
    s.add_argument("replica", type=_replica_text, metavar="[tcp://|rdma://]HOST:PORT/NAME")
    s.add_argument("--force", action="store_true",
                   help="remove even if fewer than min_replicas would be left in sync")
    s.add_argument("--json", action="store_true")

    s = command("flush", cmd_flush, "make everything written so far durable now, locally and on "
                "the replicas (what `sync -f` cannot ask of a FUSE filesystem)")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")

    s = command("check", cmd_check, "offline consistency check of a pool")
    s.add_argument("pool")
    s.add_argument("--json", action="store_true")

    s = command("verify", cmd_verify, "compare a pool with its replicas by chunk checksums")
    s.add_argument("pool", metavar="POOL|MOUNTPOINT", help="pool file, pool-set file or mount point")
    s.add_argument("--chunk", type=_chunk_arg,
                   help="checksum chunk size, a multiple of 4K up to 64M (default: the pool's "
                        "sync map chunk, 64K for pools up to 4G, the unit sync counts in too)")
    s.add_argument("--token-file", help="token for the targets (default: the one recorded in the pool)")
    s.add_argument("--json", action="store_true")

    s = command("sync", cmd_sync, "verify-and-repair: send each replica the chunks that differ")
    s.add_argument("pool", metavar="POOL|MOUNTPOINT", help="pool file, pool-set file or mount point")
    s.add_argument("--token-file", help="token for the targets (default: the one recorded in the pool)")
    s.add_argument("--json", action="store_true")

    s = command("recover", cmd_recover, "rebuild a lost or damaged local pool from a replica")
    s.add_argument("pool", help="the pool file to write")
    s.add_argument("--from", dest="source", required=True, type=_replica_arg, metavar="HOST:PORT/NAME")
    s.add_argument("--token-file", help="token for the target")
    s.add_argument("--force", action="store_true",
                   help="replace an existing pool file (not a symbolic link, nor one in use)")
    _unfinished_option(s)
    s.add_argument("--json", action="store_true")

    s = command("promote", cmd_promote, "failover: make a new primary from a replica and fence the old one")
    s.add_argument("pool", help="the pool file to write (an older copy of the pool is updated in place)")
    s.add_argument("--from", dest="source", required=True, type=_replica_arg,
                   metavar="[tcp://|rdma://]HOST:PORT/NAME")
    s.add_argument("--token-file", help="token for the targets")
    s.add_argument("--force", action="store_true",
                   help="replace an existing file that is not a copy of the pool")
    _unfinished_option(s)
    s.add_argument("--json", action="store_true")

    s = command("pools", cmd_pools, "a target's pools: owner, epoch, writer, sessions, last activity")
    s.add_argument("address", type=_target_arg, metavar="[tcp://|rdma://]HOST:PORT")
    s.add_argument("--token-file", help="token for the target")
    s.add_argument("--timeout", type=_seconds_arg, default=10.0, help="seconds (default 10)")
    s.add_argument("--json", action="store_true")

    s = command("evict", cmd_evict, "drop the session writing a pool on a target (it is gone, say)")
    s.add_argument("address", type=_target_arg, metavar="[tcp://|rdma://]HOST:PORT")
    s.add_argument("name", help="the pool's name on the target")
    s.add_argument("--token-file", help="token for the target")
    s.add_argument("--timeout", type=_seconds_arg, default=10.0, help="seconds (default 10)")

    s = command("token", cmd_token, "make a token file (256 random bits, mode 0600)")
    s.add_argument("action", choices=("new",))
    s.add_argument("file", help="the file to make (an existing one is left alone)")

    command("target", cmd_target, "the replica-node daemon (see `rpmemfs target --help`)",
            own_options=True)
    command("bench", cmd_bench, "benchmarks vs pass-through FUSE filesystems and the plain dir "
            "(see `rpmemfs bench --help`)", own_options=True)
    command("soak", cmd_soak, "writers against two replicas while targets are killed; then "
            "every acknowledged write is checked (see `rpmemfs soak --help`)", own_options=True)
    command("timeline", cmd_timeline, "fsync, replica state and lag recorded through a target's "
            "kill and restart, and plotted (see `rpmemfs timeline --help`)", own_options=True)

    s = command("demo", cmd_demo, "a demo mount in DIR; Ctrl-C stops it")
    s.add_argument("dir")
    s.add_argument("--size", type=_size_arg, default="256M",
                   help="the pool's size (default 256M); the demo takes three times that in DIR")

    s = command("ha", cmd_ha, "the Pacemaker resource agent's actions (mount/ocf/rpmemfs runs them; "
                "parameters in OCF_RESKEY_*, docs/ha.md)")
    s.add_argument("action", help="start, stop, monitor, promote, demote, notify, validate-all, meta-data")
    # Made from the parser, so that a command added above is named here too.
    p.description = textwrap.fill(f"The `rpmemfs` command: {', '.join(sub.choices)}.", width=95)
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    # Every layer's errors meant for the user derive from RpmemfsError; OSError is what the
    # commands' own file handling raises, RuntimeError the native helper's refusal to load.
    return (RpmemfsError, OSError, RuntimeError)


def _report(exc: BaseException) -> int:
    """What a command raised, as the user sees it; the exit status."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # trio wraps what a task raised
    if isinstance(exc, _user_errors()):
        sys.stderr.write(f"rpmemfs: {exc}\n")
        return 1
    if logging.getLogger("rpmemfs").isEnabledFor(logging.DEBUG):
        traceback.print_exception(exc)
        where = ""
    else:
        where = " (--log-level debug shows where)"
    sys.stderr.write(f"rpmemfs: internal error: {type(exc).__name__}: {exc}{where}\n")
    return 1


class _Output:
    """stdout or stderr while a command runs. Once its reader has gone (a closed pipe:
    `rpmemfs status MNT | head -1`), what is left to print goes nowhere and the command ends
    with the status it would have had: a reader that stopped reading is no error of the pool."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        # The descriptor becomes /dev/null: what the stream still holds, and the interpreter's
        # flush at exit, then go nowhere instead of raising again.
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _closed_pipes_tolerated() -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    # None when the descriptor was closed before we started: print() then drops the text.
    if sys.stdout is not None:
        sys.stdout = cast(TextIO, _Output(sys.stdout))
    if sys.stderr is not None:
        sys.stderr = cast(TextIO, _Output(sys.stderr))
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()  # a buffered stdout meets the closed pipe only here
        sys.stdout, sys.stderr = saved


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    with _closed_pipes_tolerated():
        logs.setup(args.log_level or DEFAULT_LOG_LEVEL)
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            return 130
        except Exception as exc:
            return _report(exc)


if __name__ == "__main__":
    sys.exit(main())
