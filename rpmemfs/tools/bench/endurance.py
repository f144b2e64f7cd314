"""The two measurements of a fresh mount that the bench's steady workloads cannot show:
fsync latency in the first seconds after `rpmemfs mount`, against the same writer's a little
later, and the daemon's memory under a long run of concurrent writers.

    python -m rpmemfs.tools.bench.endurance [--replicas N] [--minutes M] [--jobs J] [--json F]

Each run makes its own pool (and N target daemons on loopback), mounts it, and at once runs
one writer doing 4 KiB pwrite + fsync at random offsets for 2 x --window seconds: the p99 of
the first window against the second's (issue 18 asks for at most 2x). Then --jobs writer
processes run for --minutes while the daemon's resident memory is sampled every
--sample seconds: its value at the start, at the end and its peak (issue 18: flat).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rpmemfs import safeopen
from rpmemfs.tools.bench.stats import percentile
from rpmemfs.tools.bench.workloads import fork_fsync_writers
from rpmemfs.tools.processes import MountProcess, TargetProcess, run_rpmemfs

BLOCK = 4096
FILE_SIZE = 16 << 20


def _log(msg: str) -> None:
    print(f"[endurance {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rss_kib(pid: int) -> int:
    """The daemon's own memory (RssAnon: its heap, not the pool pages it maps, which VmRSS
    counts too and which grow as the pool fills)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError(f"no RssAnon for pid {pid}")


def _window(latencies_us: list[float]) -> dict[str, float]:
    s = sorted(latencies_us)
    if not s:  # one fsync outlasted the whole window
        return {"n": 0, "p50_us": 0.0, "p99_us": 0.0, "max_us": 0.0}
    return {"n": len(s), "p50_us": percentile(s, 50), "p99_us": percentile(s, 99), "max_us": s[-1]}


def startup_latency(mnt: Path, window: float) -> dict[str, Any]:
    """One writer from the moment the mount answers: per-fsync latency by window."""
    path = mnt / "startup.dat"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        rng = random.Random(1)
        buf = os.urandom(BLOCK)
        first: list[float] = []
        second: list[float] = []
        t0 = time.perf_counter()
        while True:
            now = time.perf_counter()
            if now - t0 >= 2 * window:
                break
            off = rng.randrange(FILE_SIZE // BLOCK) * BLOCK
            os.pwrite(fd, buf, off)
            a = time.perf_counter()
            os.fsync(fd)
            lat = (time.perf_counter() - a) * 1e6
            (first if a - t0 < window else second).append(lat)
    finally:
        os.close(fd)
    early, late = _window(first), _window(second)
    return {"window_s": window, "first": early, "second": late,
            "p99_ratio": early["p99_us"] / late["p99_us"] if late["p99_us"] else 0.0}


def memory_under_load(mnt: Path, pid: int, jobs: int, minutes: float, sample: float) -> dict[str, Any]:
    """``jobs`` writers (the bench's concurrent_fsync writer) for ``minutes``; the daemon's RSS
    sampled meanwhile."""
    seconds = minutes * 60
    pids, out_r = fork_fsync_writers([mnt / f"job{i}.dat" for i in range(jobs)], seconds)
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    running = set(pids)
    try:
        while running:
            samples.append((round(time.monotonic() - t0, 1), _rss_kib(pid)))
            if len(samples) % 10 == 1:
                _log(f"{samples[-1][0]:.0f}s of {seconds:.0f}s: daemon RSS {samples[-1][1] / 1024:.1f} MiB")
            time.sleep(sample)
            running = {p for p in running if os.waitpid(p, os.WNOHANG) == (0, 0)}
        samples.append((round(time.monotonic() - t0, 1), _rss_kib(pid)))
    finally:
        for p in running:
            os.kill(p, signal.SIGKILL)
            os.waitpid(p, 0)
    with os.fdopen(out_r) as out:
        ops = sum(int(line.split()[0]) for line in out.read().splitlines() if line.strip())
    # Warm-up (the first writes allocate the files' blocks, the caches fill): the start is
    # taken one sample in, where a steady run's memory should stay.
    start = samples[min(1, len(samples) - 1)][1]
    return {"jobs": jobs, "minutes": minutes, "ops": ops, "iops": ops / seconds if seconds else 0.0,
            "rss_kib_start": start, "rss_kib_end": samples[-1][1],
            "rss_kib_peak": max(v for _, v in samples), "samples": samples}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="rpmemfs-endurance-", dir=args.dir))
    try:
        with ExitStack() as stack:
            specs = []
            for i in range(args.replicas):
                pool_dir = work / f"target{i}"
                pool_dir.mkdir()
                t = TargetProcess(pool_dir, log_path=work / f"target{i}.log")
                stack.callback(t.close)
                stack.callback(t.stop)
                specs.append(f"{t.start()}/r{i}")
            run_rpmemfs("mkfs", work / "pool", "--size", args.pool_size,
                        *(a for s in specs for a in ("--replica", s)))
            mnt = work / "mnt"
            mnt.mkdir()
            m = MountProcess.rpmemfs(work / "pool", mnt, args.options, log_path=work / "mount.log")
            m.start()
            stack.callback(m.stop)
            assert m.proc is not None
            pid = m.proc.pid
            result: dict[str, Any] = {"replicas": args.replicas, "options": args.options}
            _log(f"mounted; one writer for {2 * args.window:g} s")
            result["startup"] = startup_latency(mnt, args.window)
            s = result["startup"]
            _log(f"fsync p99 first {args.window:g} s {s['first']['p99_us']:.0f} us, next "
                 f"{s['second']['p99_us']:.0f} us: {s['p99_ratio']:.2f}x")
            if args.minutes > 0:
                _log(f"{args.jobs} writers for {args.minutes:g} min")
                result["memory"] = memory_under_load(mnt, pid, args.jobs, args.minutes, args.sample)
                mem = result["memory"]
                _log(f"daemon RSS {mem['rss_kib_start'] / 1024:.1f} MiB at the start, "
                     f"{mem['rss_kib_end'] / 1024:.1f} at the end, peak {mem['rss_kib_peak'] / 1024:.1f}; "
                     f"{mem['iops']:,.0f} IOPS")
            return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rpmemfs.tools.bench.endurance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="target daemons on loopback (default 2)")
    p.add_argument("--options", default="pmem=force", help="mount options (default pmem=force)")
    p.add_argument("--pool-size", default="1G")
    p.add_argument("--window", type=float, default=10.0, help="seconds per latency window (default 10)")
    p.add_argument("--minutes", type=float, default=10.0, help="the memory run; 0 skips it (default 10)")
    p.add_argument("--jobs", type=int, default=16, help="writer processes of the memory run (default 16)")
    p.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    p.add_argument("--dir", default="/dev/shm", help="where the work directory is made")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.replicas < 0 or args.window <= 0 or args.minutes < 0 or args.jobs < 1:
        p.error("--replicas, --minutes must be >= 0; --window > 0; --jobs >= 1")
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        safeopen.write_text(args.json, text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "memory"}
                     | ({"memory": {k: v for k, v in result["memory"].items() if k != "samples"}}
                        if "memory" in result else {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
