"""Command line of `rpmemfs bench`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rpmemfs.cliparse import ArgumentParser
from rpmemfs.tools.bench.targets import (
    ASYNC_TARGETS,
    DEFAULT_TARGETS,
    PROTECTION_TARGETS,
    REPLICA_TARGETS,
    TARGET_NAMES,
)
from rpmemfs.tools.bench.workloads import WORKLOADS

MOUNT100K = "mount100k"
DEFAULT_MOUNT_FILES = 100_000
# Five rounds of five workloads on the five default targets take about 2.5 minutes on
# the shared 2-core dev machine (docs/benchmarks.md), well inside what a full run may
# cost, and a median of five survives two spoilt rounds.
DEFAULT_ROUNDS = 5


@dataclass(frozen=True)
class Options:
    base_dir: Path
    quick: bool
    json_path: Path | None
    workloads: tuple[str, ...]
    # In TARGET_NAMES order, whatever order they were given in, so columns are stable.
    targets: tuple[str, ...]
    pool_size: str
    # None: the slow mount-time measurement is not run.
    mount_files: int | None
    rounds: int
    timeout: float
    keep: bool


def _parser() -> argparse.ArgumentParser:
    names = ", ".join([*WORKLOADS, MOUNT100K])
    p = ArgumentParser(
        prog="rpmemfs bench",
        description="Compare rpmemfs with a pass-through FUSE filesystem and a plain "
                    "directory on the same backing store, each FUSE filesystem with and "
                    "without extended attributes.",
    )
    p.add_argument("--dir", type=Path, default=Path("/dev/shm"), metavar="DIR",
                   help="where the fresh work directory is made (default: /dev/shm)")
    p.add_argument("--quick", action="store_true",
                   help="about 10x fewer operations, for a smoke run")
    p.add_argument("--json", type=Path, metavar="FILE", dest="json_path",
                   help="also write every number to FILE as JSON")
    p.add_argument("--only", metavar="NAME[,NAME]",
                   help=f"run only these workloads ({names})")
    p.add_argument("--targets", metavar="NAME[,NAME]",
                   help=f"compare only these targets ({', '.join(TARGET_NAMES)}; default: "
                        f"{', '.join(DEFAULT_TARGETS)})")
    p.add_argument("--replicas", action="store_true",
                   help=f"compare 0, 1 and 2 replicas: the targets {', '.join(REPLICA_TARGETS)} "
                        "(the replicas are target daemons started on loopback)")
    p.add_argument("--async", action="store_true", dest="async_",
                   help=f"compare 2 replicas with replication=async with 0 replicas and 2 "
                        f"synchronous ones: the targets {', '.join(ASYNC_TARGETS)}")
    p.add_argument("--protection", action="store_true",
                   help=f"compare one replica with wire protection on and off: the targets "
                        f"{', '.join(PROTECTION_TARGETS)} (docs/wire.md)")
    p.add_argument("--micro", action="store_true",
                   help="run the replication microbenchmark below FUSE instead "
                        "(barrier latency per persistence method; see "
                        "`python -m rpmemfs.tools.bench.micro --help`)")
    p.add_argument("--pool-size", default="1G", metavar="SIZE",
                   help="size of the rpmemfs pool, as `rpmemfs mkfs --size` takes it "
                        f"(default: 1G; {MOUNT100K} makes its pool bigger when its files need it)")
    p.add_argument("--mount-files", type=int, metavar="N",
                   help=f"also run {MOUNT100K} with N files (default N: {DEFAULT_MOUNT_FILES:,}, "
                        f"{DEFAULT_MOUNT_FILES // 10:,} with --quick)")
    p.add_argument("--rounds", type=int, metavar="N",
                   help="repeat every workload N times, interleaved over the targets, and "
                        f"report the median (default: {DEFAULT_ROUNDS}, 1 with --quick)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="give up on a target after one workload ran this long (default: 300)")
    p.add_argument("--keep", action="store_true",
                   help="keep the work directory (pool, daemon logs) for inspection")
    return p


def parse(argv: list[str]) -> Options:
    parser = _parser()
    args = parser.parse_args(argv)

    selected: list[str] = list(WORKLOADS)
    mount_wanted = args.mount_files is not None
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n != MOUNT100K and n not in WORKLOADS]
        if unknown:
            parser.error(f"unknown workload(s): {', '.join(unknown)}")
        selected = [n for n in names if n in WORKLOADS]
        mount_wanted = mount_wanted or MOUNT100K in names

    mount_files: int | None = None
    if mount_wanted:
        default = DEFAULT_MOUNT_FILES // 10 if args.quick else DEFAULT_MOUNT_FILES
        mount_files = args.mount_files if args.mount_files is not None else default
        if mount_files < 1:
            parser.error("--mount-files must be at least 1")

    if not selected and mount_files is None:
        parser.error("--only selected nothing to run")

    targets: tuple[str, ...] = DEFAULT_TARGETS
    chosen = [flag for flag, on in (("--replicas", args.replicas), ("--async", args.async_),
                                    ("--protection", args.protection),
                                    ("--targets", args.targets is not None)) if on]
    if len(chosen) > 1:
        parser.error(f"{' and '.join(chosen)} each select the targets; give one of them")
    if args.replicas:
        targets = tuple(n for n in TARGET_NAMES if n in REPLICA_TARGETS)
    elif args.async_:
        targets = tuple(n for n in TARGET_NAMES if n in ASYNC_TARGETS)
    elif args.protection:
        targets = tuple(n for n in TARGET_NAMES if n in PROTECTION_TARGETS)
    elif args.targets is not None:
        wanted = [n.strip() for n in args.targets.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in TARGET_NAMES]
        if unknown:
            parser.error(f"unknown target(s): {', '.join(unknown)} "
                         f"(known: {', '.join(TARGET_NAMES)})")
        if not wanted:
            parser.error("--targets selected nothing")
        targets = tuple(n for n in TARGET_NAMES if n in wanted)

    rounds = args.rounds if args.rounds is not None else (1 if args.quick else DEFAULT_ROUNDS)
    if rounds < 1:
        parser.error("--rounds must be at least 1")

    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir}: not a directory")

    return Options(
        base_dir=args.dir,
        quick=args.quick,
        json_path=args.json_path,
        workloads=tuple(dict.fromkeys(selected)),
        targets=targets,
        pool_size=args.pool_size,
        mount_files=mount_files,
        rounds=rounds,
        timeout=args.timeout,
        keep=args.keep,
    )
