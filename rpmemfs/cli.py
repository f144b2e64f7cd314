"""The `rpmemfs` command: mkfs, mount, status, check, verify, sync, recover, bench, demo."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from rpmemfs import logs
from rpmemfs.units import human, parse_size


class CliError(Exception):
    pass


def _progress(label: str):  # type: ignore[no-untyped-def]
    """A progress callback drawing a bar on stderr when it is a terminal, else silent."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{human(done)}/{human(total)}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _token(path: str | None) -> bytes | None:
    if path is None:
        return None
    from rpmemfs.transport.auth import TokenError, read_token_file

    try:
        return read_token_file(path)
    except (TokenError, OSError) as e:
        raise CliError(f"token file {path}: {e}") from None


def cmd_mkfs(args: argparse.Namespace) -> int:
    from rpmemfs.fs.mkfs import MkfsError
    from rpmemfs.mountd.provision import ProvisionError, create_pool
    from rpmemfs.replica.spec import PoolSetError, ReplicaSpec, poolset_at

    pool, size_text, specs = args.pool, args.size, []
    try:
        for text in args.replica or []:
            specs.append(ReplicaSpec.parse(text))
        ps = poolset_at(pool)
        if ps is not None:
            if size_text is not None and parse_size(size_text) != ps.size:
                raise CliError(f"--size {size_text} disagrees with the pool set's {ps.size} bytes")
            pool, size, specs = ps.path, ps.size, ps.replicas + specs
        elif size_text is None:
            raise CliError("--size is required (or give a pool-set file)")
        else:
            size = parse_size(size_text)
    except (ValueError, PoolSetError) as e:
        raise CliError(str(e)) from None
    token = _token(args.token_file)
    try:
        hdr = create_pool(pool, size, specs, token=token, token_file=args.token_file,
                          force=args.force, progress=_progress("mkfs"))
    except MkfsError as e:
        raise CliError(str(e)) from None
    except ProvisionError as e:
        raise CliError(f"pool {pool} is made, but not all replicas: {e}") from None
    print(f"created pool {pool}: {human(hdr.pool_size)}, uuid {hdr.uuid_str}, "
          f"{hdr.data_blocks} data blocks, log areas of {human(hdr.area_size)}"
          + "".join(f"\n  replica {s}" for s in specs))
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from rpmemfs.mountd.daemon import MountError, run

    try:
        return run(args.pool, args.mountpoint, args.o or [], args.foreground)
    except MountError as e:
        raise CliError(str(e)) from None


def _status(mountpoint: str) -> dict[str, Any]:
    from rpmemfs.mountd import control

    if not os.path.ismount(mountpoint):
        raise CliError(f"{mountpoint} is not a mount point")
    try:
        return control.query(mountpoint)
    except (OSError, ValueError) as e:
        raise CliError(f"no rpmemfs daemon answers for {mountpoint} ({e})") from None


def cmd_status(args: argparse.Namespace) -> int:
    st = _status(args.mountpoint)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    lat = st["fsync_latency_us"]
    print(f"mount      {st['mountpoint']}\npool       {st['pool']} ({st['uuid']})\n"
          f"size       {human(st['size'])}, used {human(st['used'])} of {human(st['data_size'])}, "
          f"{st['inodes']} inodes\n"
          f"pmem       {st['pmem_mode']} (requested {st['pmem_requested']})\n"
          f"fsync      {st['fsync_count']} calls, p50 {lat['p50']:.1f} us, p99 {lat['p99']:.1f} us\n"
          f"polling    {st['poll_us']} us after each request\n"
          f"log        area {st['log']['area']} gen {st['log']['generation']}, "
          f"{human(st['log']['used'])} of {human(st['log']['capacity'])}, "
          f"{st['log']['checkpoints']} checkpoints")
    for r in st.get("replicas", []):
        print(f"replica    {r}")
    return 0


def _mounted_from(pool: str) -> str | None:
    """The mountpoint where ``pool`` is mounted now, if it is."""
    want = "rpmemfs:" + os.path.abspath(pool)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 1 and fields[0].replace("\\040", " ") == want:
                    return fields[1]
    except OSError:
        pass
    return None


def _ask_mount(mountpoint: str, request: str, label: str) -> dict[str, Any]:
    """A long request to a mount's daemon, with a progress bar from its progress lines."""
    from rpmemfs.mountd import control

    show = _progress(label)
    try:
        reply = control.query(mountpoint, request, timeout=None, progress=show)
    except (OSError, ValueError) as e:
        raise CliError(f"no rpmemfs daemon answers for {mountpoint} ({e})") from None
    if "error" in reply and len(reply) == 1:
        raise CliError(str(reply["error"]))
    return reply


def _unmounted_pool(path: str, what: str) -> tuple[str, list[Any] | None]:
    """(pool file, replicas from a pool-set file or None) for a command on an unmounted pool."""
    from rpmemfs.replica.spec import PoolSetError, poolset_at

    pool, specs = path, None
    try:
        ps = poolset_at(pool)
    except PoolSetError as e:
        raise CliError(str(e)) from None
    if ps is not None:
        pool, specs = ps.path, ps.replicas
    if not os.path.isfile(pool):
        raise CliError(f"{path} is neither a pool file nor a mount point")
    where = _mounted_from(pool)
    if where:
        raise CliError(f"pool {pool} is mounted at {where}: {what} the mount point instead "
                       f"(rpmemfs {what} {where})")
    return pool, specs


def _chunk(text: str) -> int:
    from rpmemfs.units import parse_size

    try:
        chunk = parse_size(text)
    except ValueError as e:
        raise CliError(str(e)) from None
    if chunk < 4096 or chunk % 4096 or chunk > 64 << 20:
        raise CliError("--chunk must be a multiple of 4K, at most 64M")
    return chunk


@contextlib.contextmanager
def _replicated_pool(path: str, token_file: str | None, what: str, writable: bool
                     ) -> Iterator[tuple[str, Any, list[Any], bytes | None]]:
    """(pool file, its mapping, its replicas, the token) of an unmounted pool, for verify and
    sync; the mapping is closed afterwards."""
    from rpmemfs.pmem import PmemError, PoolMapping
    from rpmemfs.replica.table import inspect_table

    pool, specs = _unmounted_pool(path, what)
    try:
        pm = PoolMapping.open(pool, "msync", readonly=not writable, exclusive=writable)
    except PmemError as e:
        raise CliError(str(e)) from None
    try:
        table = inspect_table(pm.buf)
        specs = specs if specs is not None else table.replicas
        if not specs:
            raise CliError(f"pool {pool} has no replicas to {what}")
        yield pool, pm, specs, _token(token_file or table.token_file)
    finally:
        try:
            pm.close()
        except BufferError:
            pass  # a view is still referenced; the process exits and unmaps anyway


def cmd_verify(args: argparse.Namespace) -> int:
    import trio

    from rpmemfs.replica.verify import format_report, report_from_dict, verify

    chunk = _chunk(args.chunk)
    if os.path.isdir(args.pool) and os.path.ismount(args.pool):
        report = report_from_dict(_ask_mount(args.pool, f"verify {chunk}", "verify"))
    else:
        opened = _replicated_pool(args.pool, args.token_file, "verify", writable=False)
        with opened as (pool, pm, specs, token):
            report = trio.run(verify, pool, pm.buf, specs, token, chunk)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.clean else 1


def cmd_sync(args: argparse.Namespace) -> int:
    import trio

    from rpmemfs.replica.repair import RepairError, format_sync, sync_pool
    from rpmemfs.replica.verify import Progress, content_size

    if os.path.isdir(args.pool) and os.path.ismount(args.pool):
        result = _ask_mount(args.pool, "sync", "sync")
    else:
        opened = _replicated_pool(args.pool, args.token_file, "sync", writable=True)
        with opened as (pool, pm, specs, token):
            bar = Progress(content_size(pm.buf) * len(specs), "sync")
            try:
                result = trio.run(sync_pool, pool, pm, specs, token, bar).as_dict()
            except RepairError as e:
                raise CliError(str(e)) from None
            finally:
                bar.close()
    print(json.dumps(result, indent=2) if args.json else format_sync(result))
    return 0 if result.get("clean") else 1


def cmd_recover(args: argparse.Namespace) -> int:
    import trio

    from rpmemfs.replica.repair import RepairError, recover_pool
    from rpmemfs.replica.spec import ReplicaSpec

    if _mounted_from(args.pool):
        raise CliError(f"pool {args.pool} is mounted; unmount it before replacing it")
    try:
        source = ReplicaSpec.parse(args.source)
    except ValueError as e:
        raise CliError(str(e)) from None
    token = _token(args.token_file)
    try:
        result = trio.run(lambda: recover_pool(args.pool, source, token, force=args.force,
                                               progress=_progress("recover")))
    except RepairError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"recovered {result['pool']} from {result['from']}: {result['bytes']} bytes, "
              f"{result['chunks_verified']} chunks verified by checksum, {result['seconds']:.2f} s")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from rpmemfs.fs.check import check, format_report
    from rpmemfs.pmem import PmemError, PoolMapping

    if not os.path.isfile(args.pool):
        raise CliError(f"pool {args.pool} does not exist or is not a file")
    try:
        pm = PoolMapping.open(args.pool, "msync", readonly=True)
    except PmemError as e:
        raise CliError(str(e)) from None
    try:
        report = check(pm.buf, args.pool)
    finally:
        pm.close()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["clean"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from rpmemfs.tools import bench

    return bench.main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from rpmemfs.tools.demo import run_demo

    return run_demo(args.dir, args.size)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rpmemfs", description=__doc__)
    p.add_argument("--log-level", default="warning", help="debug, info, warning (default), error")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("mkfs", help="make a pool file")
    s.add_argument("pool")
    s.add_argument("--size", help="pool size, e.g. 64M, 4G (a pool-set file gives its own)")
    s.add_argument("--force", action="store_true", help="overwrite an existing file")
    s.add_argument("--replica", action="append", metavar="HOST:PORT/NAME",
                   help="make a replica pool NAME on the target daemon at HOST:PORT")
    s.add_argument("--token-file", help="shared token for the target daemons")
    s.set_defaults(func=cmd_mkfs)

    s = sub.add_parser("mount", help="mount a pool")
    s.add_argument("pool")
    s.add_argument("mountpoint")
    s.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    s.add_argument("-o", action="append", metavar="OPT[,OPT...]",
                   help="pmem=auto|force|msync, log=FILE, debug, allow_other")
    s.set_defaults(func=cmd_mount)

    s = sub.add_parser("status", help="show a mount's state")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("check", help="offline consistency check of a pool")
    s.add_argument("pool")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("verify", help="compare a pool with its replicas by chunk checksums")
    s.add_argument("pool", metavar="POOL|MOUNTPOINT", help="pool file, pool-set file or mount point")
    s.add_argument("--chunk", default="1M", help="checksum chunk size (default 1M)")
    s.add_argument("--token-file", help="token for the targets (default: the one recorded in the pool)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("sync", help="verify-and-repair: send each replica the chunks that differ")
    s.add_argument("pool", metavar="POOL|MOUNTPOINT", help="pool file, pool-set file or mount point")
    s.add_argument("--token-file", help="token for the targets (default: the one recorded in the pool)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_sync)

    s = sub.add_parser("recover", help="rebuild a lost or damaged local pool from a replica")
    s.add_argument("pool", help="the pool file to write")
    s.add_argument("--from", dest="source", required=True, metavar="HOST:PORT/NAME")
    s.add_argument("--token-file", help="token for the target")
    s.add_argument("--force", action="store_true", help="replace an existing file")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_recover)

    s = sub.add_parser("bench", help="benchmarks vs pass-through FUSE filesystems and the plain dir",
                       add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("soak", help="writers against two replicas while targets are killed; "
                       "then every acknowledged write is checked (see `rpmemfs soak --help`)", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)

    s = sub.add_parser("target", help="the replica-node daemon (see `rpmemfs target --help`)",
                       add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)

    s = sub.add_parser("demo", help="a demo mount in DIR; Ctrl-C stops it")
    s.add_argument("dir")
    s.add_argument("--size", default="256M")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["target"]:
        # The replica-node daemon parses its own options.
        from rpmemfs.target import main as target_main

        return target_main(argv[1:])
    if argv[:1] == ["bench"]:
        # The benchmark has its own options; argparse's REMAINDER would refuse "--quick".
        from rpmemfs.tools import bench

        return bench.main(argv[1:])
    if argv[:1] == ["soak"]:
        # Writers, faults and a final check of every acknowledged write; its own options.
        from rpmemfs.tools import soak

        return soak.main(argv[1:])
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    try:
        return int(args.func(args))
    except CliError as e:
        sys.stderr.write(f"rpmemfs: {e}\n")
        return 1
    except RuntimeError as e:  # the native helper's refusal, among others
        sys.stderr.write(f"rpmemfs: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
