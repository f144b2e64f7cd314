"""Replication microbenchmark below FUSE: what one barrier to one replica costs.

`rpmemfs bench --micro` or `python -m rpmemfs.tools.bench.micro`. Two target daemons on
loopback, one `--pmem force --persist apm` and one with the defaults (gpspm); a local pool
made with `rpmemfs.fs.mkfs.mkfs` on tmpfs and mapped with pmem mode "force"; for each
target in turn a replica pool is created from it (`create_remote`) and opened as a
one-replica `ReplicaSet` with one lane, so a barrier and the bare read share that lane.

Per method the timed operations are, each on its own, awaited one after another:

- `read 8 B`: `lane.read(region, 0, 8)`, the bare round trip of the lane (no write, no
  flush): the floor under every barrier;
- `1x4K`, `16x4K` (16 ranges 8 KiB apart, so nothing coalesces), `1x1M`:
  `ReplicaSet.barrier(ranges)`, which is what the filesystem calls at a durability point.

Rounds interleave the two methods so drifting load on a shared machine hits both.

With `--protection` each method runs twice, against two target daemons: one with wire
protection (the default: every byte sealed, docs/wire.md) and one started with
`--wire-protection none` and reached in plaintext (`apm-plain`, `gpspm-plain`), rounds
interleaved over all four, and the ratios of their p50s are printed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import trio

from rpmemfs import safeopen
from rpmemfs.cliparse import ArgumentParser
from rpmemfs.fs.mkfs import mkfs
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.layout import Header
from rpmemfs.replica import ReplicaSet, ReplicaSpec, ReplicaState, create_remote, metadata_ranges
from rpmemfs.tools.bench.machine import describe, one_line
from rpmemfs.tools.bench.notes import note
from rpmemfs.tools.bench.stats import percentile
from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport import protection
from rpmemfs.transport.base import Lane, RemoteRegion

KIB = 1 << 10
MIB = 1 << 20
POOL_SIZE = 64 * MIB
# Where in the data region the barriers write: eight 2 MiB slots, used in turn.
SLOTS = 8
SLOT = 2 * MIB
ROUNDS = 5

# (pmem, persist) of each target daemon, keyed by the method it advertises.
METHODS: dict[str, tuple[str | None, str | None]] = {
    "apm": ("force", "apm"),
    "gpspm": (None, None),
}
PLAIN = "-plain"  # a variant of a method whose both ends run with wire protection none


def _method(variant: str) -> str:
    return variant.removesuffix(PLAIN)

READ = "read 8 B"
B1x4K = "1x4K"
B16x4K = "16x4K"
B1x1M = "1x1M"
CASES = (READ, B1x4K, B16x4K, B1x1M)


@dataclass
class CaseResult:
    method: str
    case: str
    iterations: int
    bytes_per_op: int
    p50_us: float
    p99_us: float
    mean_us: float
    mb_per_s: float | None


@dataclass
class MicroResult:
    machine: dict[str, str | int]
    workdir: str
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float] | None = None
    iterations: dict[str, int] = field(default_factory=dict)
    cases: list[CaseResult] = field(default_factory=list)

    def get(self, method: str, case: str) -> CaseResult | None:
        for c in self.cases:
            if c.method == method and c.case == case:
                return c
        return None


def _ranges(case: str, data_off: int, i: int) -> list[tuple[int, int]]:
    base = data_off + (i % SLOTS) * SLOT
    if case == B1x4K:
        return [(base, 4 * KIB)]
    if case == B16x4K:
        return [(base + k * 8 * KIB, 4 * KIB) for k in range(16)]
    if case == B1x1M:
        return [(base, MIB)]
    raise ValueError(case)


async def _time(op: Callable[[int], Awaitable[object]], start: int, n: int,
                out: list[int]) -> None:
    clock = time.perf_counter_ns
    for i in range(start, start + n):
        t0 = clock()
        await op(i)
        out.append(clock() - t0)


async def _one_method(method: str, address: str, pm: PoolMapping, iterations: dict[str, int],
                      warmup: dict[str, int], rounds: int,
                      samples: dict[tuple[str, str], list[int]], round_no: int) -> None:
    """One round of every case on a fresh one-replica set for ``method``."""
    hdr = Header.decode(pm.buf)
    spec = ReplicaSpec.make(address, f"micro-{method}")
    # A plaintext variant's target runs with --wire-protection none: so must this end.
    wire_protection = "none" if method.endswith(PLAIN) else protection.DEFAULT
    if round_no == 0:
        await create_remote(spec, pm.size, pm.buf, metadata_ranges(pm.buf), wire_protection=wire_protection)
    rs = await ReplicaSet.open([spec], pm.buf, hdr.uuid, None, lanes=1, wire_protection=wire_protection)
    try:
        replica = rs.replicas[0]
        if replica.state is not ReplicaState.IN_SYNC or replica.region is None:
            raise RuntimeError(f"{spec}: {replica.last_error or replica.state}")
        region: RemoteRegion = replica.region
        if region.method != _method(method):
            raise RuntimeError(f"{spec}: target advertises {region.method}, expected {_method(method)}")
        lane: Lane = replica.lanes[0]

        async def read(_: int) -> None:
            await lane.read(region, 0, 8)

        def barrier(case: str) -> Callable[[int], Awaitable[None]]:
            async def op(i: int) -> None:
                await rs.barrier(_ranges(case, hdr.data_off, i))
            return op

        for case in CASES:
            op = read if case == READ else barrier(case)
            # Every round gets its share; the first rounds take the remainder.
            per_round = iterations[case] // rounds + (round_no < iterations[case] % rounds)
            await _time(op, 0, warmup[case], [])
            await _time(op, round_no * per_round, per_round,
                        samples.setdefault((method, case), []))
    finally:
        await rs.aclose()


def _result(method: str, case: str, samples: list[int], data_off: int) -> CaseResult:
    ordered = sorted(samples)
    mean_ns = sum(samples) / len(samples)
    nbytes = 8 if case == READ else sum(n for _, n in _ranges(case, data_off, 0))
    return CaseResult(
        method=method, case=case, iterations=len(samples), bytes_per_op=nbytes,
        p50_us=percentile(ordered, 50) / 1e3, p99_us=percentile(ordered, 99) / 1e3,
        mean_us=mean_ns / 1e3,
        mb_per_s=None if case == READ else nbytes / (mean_ns / 1e9) / 1e6,
    )


def run(base_dir: Path, quick: bool, small: int | None, large: int | None,
        rounds: int, keep: bool, plain_too: bool = False) -> MicroResult:
    n_small = small if small is not None else (200 if quick else 2000)
    n_large = large if large is not None else (30 if quick else 300)
    iterations = {READ: n_small, B1x4K: n_small, B16x4K: n_small, B1x1M: n_large}
    warmup = {READ: 20, B1x4K: 20, B16x4K: 20, B1x1M: 3}
    rounds = max(1, min(rounds, n_large))
    workdir = Path(tempfile.mkdtemp(prefix="rpmemfs-micro-", dir=base_dir))
    result = MicroResult(machine=describe(), workdir=str(workdir),
                         load_before=os.getloadavg(), iterations=iterations)
    note(f"micro: work dir {workdir}; {n_small} small, {n_large} 1 MiB barriers, "
         f"{rounds} rounds per method")
    daemons: dict[str, TargetProcess] = {}
    try:
        methods = [v for m in METHODS for v in ((m, m + PLAIN) if plain_too else (m,))]
        for method in methods:
            pmem, persist = METHODS[_method(method)]
            pool_dir = workdir / f"target-{method}"
            pool_dir.mkdir()
            extra = ("--wire-protection", "none") if method.endswith(PLAIN) else ()
            daemons[method] = TargetProcess(pool_dir, pmem=pmem, persist=persist, extra=extra,
                                            log_level="warning",
                                            log_path=workdir / f"target-{method}.log")
            daemons[method].start()
        pool = workdir / "local.pool"
        mkfs(str(pool), POOL_SIZE)
        with PoolMapping.open(str(pool), "force") as pm:
            hdr = Header.decode(pm.buf)
            end = hdr.data_off + SLOTS * SLOT
            if end > pm.size:
                raise RuntimeError(f"pool of {pm.size} bytes is too small for the slots")
            # Something other than zeros, though nothing reads it back.
            pm.buf[hdr.data_off:end] = os.urandom(end - hdr.data_off)
            samples: dict[tuple[str, str], list[int]] = {}
            for round_no in range(rounds):
                k = round_no % len(methods)
                order = methods[k:] + methods[:k]
                for method in order:
                    note(f"micro: round {round_no + 1}/{rounds}: {method}")
                    trio.run(_one_method, method, daemons[method].address, pm, iterations,
                             warmup, rounds, samples, round_no)
            for method in methods:
                for case in CASES:
                    result.cases.append(_result(method, case, samples[(method, case)],
                                                hdr.data_off))
    finally:
        for method, daemon in daemons.items():
            code = daemon.stop()
            if code != 0:
                note(f"micro: {method} target exited with {code}:\n{daemon.log_text()}")
            daemon.close()
        if keep:
            note(f"micro: kept work dir {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result.load_after = os.getloadavg()
    return result


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def render(result: MicroResult) -> str:
    header = ["method", "operation", "n", "p50 µs", "p99 µs", "mean µs", "MB/s",
              "p50 - read p50"]
    rows: list[list[str]] = []
    ratio_lines: list[str] = []
    variants = list(dict.fromkeys(c.method for c in result.cases))
    for method in variants:
        floor = result.get(method, READ)
        for case in CASES:
            c = result.get(method, case)
            if c is None:
                continue
            over = "-" if case == READ or floor is None else _fmt(c.p50_us - floor.p50_us)
            rows.append([method, c.case, str(c.iterations), _fmt(c.p50_us), _fmt(c.p99_us),
                         _fmt(c.mean_us), _fmt(c.mb_per_s), over])
        one, many = result.get(method, B1x4K), result.get(method, B16x4K)
        if one is not None and many is not None:
            ratio_lines.append(f"  {method}: 16x4K/1x4K p50 = {many.p50_us / one.p50_us:.2f}x")
        if method.endswith(PLAIN):
            sealed = {c.case: c for c in result.cases if c.method == _method(method)}
            plain = {c.case: c for c in result.cases if c.method == method}
            ratio_lines.append(
                f"  {_method(method)}: protected/plain p50 = " + ", ".join(
                    f"{case} {sealed[case].p50_us / plain[case].p50_us:.2f}x"
                    for case in CASES if case in sealed and case in plain))
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(widths[c]) if c < 2 else cell.rjust(widths[c])
                         for c, cell in enumerate(cells)).rstrip()

    def load(x: tuple[float, float, float] | None) -> str:
        return "?" if x is None else " ".join(f"{v:.2f}" for v in x)

    return "\n".join([
        one_line(result.machine),
        f"work dir: {result.workdir}; local pool {POOL_SIZE // MIB} MiB, pmem=force; one "
        "replica at a time, one lane, targets on 127.0.0.1",
        f"load average (1/5/15 min): {load(result.load_before)} before, "
        f"{load(result.load_after)} after",
        "",
        line(header),
        line(["-" * w for w in widths]),
        *(line(r) for r in rows),
        "",
        "ratio of the p50s:",
        *ratio_lines,
        "read 8 B: lane.read(region, 0, 8), the lane's bare round trip; the others are "
        "ReplicaSet.barrier(ranges)",
        "(16x4K: 16 ranges 8 KiB apart). apm: target --pmem force --persist apm, flush = "
        "8-byte read;",
        "gpspm: target with defaults, flush = SEND of the range list. MB/s = bytes per "
        "barrier / mean latency, 1 MB = 10^6 bytes.",
        *(["-plain: the same with wire protection none on both ends (the others are sealed, "
           "the default)."] if any(v.endswith(PLAIN) for v in variants) else []),
    ])


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="rpmemfs bench --micro",
        description="Barrier latency to one replica, per persistence method, below FUSE.")
    p.add_argument("--dir", type=Path, default=Path("/dev/shm"), metavar="DIR",
                   help="where the work directory is made (default: /dev/shm)")
    p.add_argument("--quick", action="store_true", help="10x fewer iterations")
    p.add_argument("--iterations", type=int, metavar="N",
                   help="iterations of the small operations (default 2000, 200 with --quick)")
    p.add_argument("--large-iterations", type=int, metavar="N",
                   help="iterations of the 1 MiB barrier (default 300, 30 with --quick)")
    p.add_argument("--rounds", type=int, default=ROUNDS, metavar="N",
                   help=f"split the iterations over N rounds, methods interleaved "
                        f"(default {ROUNDS})")
    p.add_argument("--json", type=Path, metavar="FILE", dest="json_path",
                   help="also write every number to FILE as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--protection", action="store_true",
                   help="also run each method in plaintext (--wire-protection none on both "
                        "ends) and print protected/plain ratios")
    args = p.parse_args(argv)
    for name in ("iterations", "large_iterations", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    result = run(args.dir, args.quick, args.iterations, args.large_iterations, args.rounds,
                 args.keep, args.protection)
    print(render(result), flush=True)
    if args.json_path is not None:
        safeopen.write_text(args.json_path, json.dumps(asdict(result), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
