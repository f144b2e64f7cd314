"""Barriers over real verbs (Soft-RoCE in the VM), beside perftest on the same rxe pair.

`scripts/bench-verbs.sh` (which boots the VM) or, inside it, `python -m rpmemfs.tools.bench.verbs`.
Needs two RDMA devices with addresses in RXE_IP_A (initiator) and RXE_IP_B (targets).

The floor comes from perftest on the same pair, in the same run: `ib_write_lat -s 4096`,
`ib_read_lat -s 8` (t_typical, perftest's median) and `ib_write_bw -s 1M`. Then two target
daemons listen on RXE_IP_B, both with `--pmem force` so the methods differ only in the flush:
one `--persist apm`, one `--persist gpspm`. Per method, one session with one lane:

- `1x4K`, `16x4K` (16 ranges 8 KiB apart): `post` of `LocalRanges` + `wait`, one at a time;
- `1x1M`: the same with one 1 MiB range, reported as MB/s;
- `pipelined 4K`: 64 barriers of 4 KiB posted before the first is awaited, as barriers/s.

Ratios: appliance 1x4K against ib_write_lat(4K) + ib_read_lat(8 B) (what a barrier is made
of: one write, then one read behind it); general-purpose against appliance; 1x1M against
ib_write_bw. Where the device and rdma-core offer native RDMA FLUSH (VERBS_STACK=flush
scripts/bench-verbs.sh: Linux 6.12 and pyverbs 59), the appliance target is also measured with
method "flush": the same writes ended by one FLUSH instead of the READ.

Persistent memory on the target's end: where the VM has a device DAX namespace
(RPMEMFS_DAX_DEVS, which scripts/bench-verbs.sh asks for), a third target serves a pool on it
(`--pool-dev`, so it declares apm itself and registers the device for FLUSH of the persistent
type where rxe grants it), and its barriers are measured ended by the READ (`devdax read`),
and where the stack has native FLUSH by one of the persistent type (`devdax persistent`: the
range written back to the target's persistence domain before the answer) and of the
global-visibility type (`devdax visibility`), on the same pool, in the same run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from rpmemfs import safeopen
from rpmemfs.native import ffi
from rpmemfs.tools.bench.stats import percentile
from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport.base import LocalPool, LocalRanges, RemoteRegion
from rpmemfs.transport.tokens import read_token_file

KIB = 1 << 10
MIB = 1 << 20
POOL = 64 * MIB
# What every barrier touches lies below 33 MiB: a pool of 48 MiB fits the VM's 62 MiB devices.
DAX_POOL = 48 * MIB
DAX_POOL_NAME = "bench-dax"
PERFTEST_PORT = 18515


def _log(msg: str) -> None:
    print(f"[bench-verbs] {msg}", file=sys.stderr, flush=True)


def perftest(tool: str, size: int, iters: int, dev_a: str, dev_b: str, ip_b: str) -> dict[str, float]:
    """One perftest between the two devices; its result line as numbers."""
    common = ["-x", "1", "-F", "-s", str(size), "-n", str(iters), "-p", str(PERFTEST_PORT)]
    server = subprocess.Popen([tool, "-d", dev_b, *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        time.sleep(2.0)  # the server must listen first; under TCG its start takes a while
        out = subprocess.run([tool, "-d", dev_a, *common, ip_b], capture_output=True, text=True, timeout=300)
    finally:
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    text = out.stdout + out.stderr
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == str(size) and len(fields) >= 5:
            nums = [float(f) for f in fields if re.fullmatch(r"[0-9.]+", f)]
            if "bw" in tool:  # bytes, iterations, BW peak, BW average, MsgRate
                return {"bw_peak_MBps": nums[2], "bw_avg_MBps": nums[3]}
            # bytes, iterations, t_min, t_max, t_typical, t_avg, t_stdev, 99%, 99.9%
            return {"min_us": nums[2], "typical_us": nums[4], "avg_us": nums[5], "p99_us": nums[7]}
    raise RuntimeError(f"{tool}: no result line in its output:\n{text[-2000:]}")


async def _methods(persist: str, address: str, token: bytes, src: str, iters: int) -> dict[str, Any]:
    """Every method a target of ``persist`` allows, each measured on one lane: gpspm; apm by
    the 8-byte READ and, where both ends have it, by native FLUSH ("flush")."""
    from rpmemfs.transport.verbs import connect

    out: dict[str, Any] = {}
    async with await connect(address, token, lanes=1, timeout=60, src=src) as session:
        flush = persist == "apm" and session.lanes[0].native_flush
        for method in [persist, *(["flush"] if flush else [])]:
            _log(f"{method}: barriers")
            out[method] = await _method(session, method, iters)
    return out


async def _devdax(address: str, token: bytes, src: str, iters: int) -> dict[str, Any]:
    """The barriers to a pool on device DAX: by READ, and by each native FLUSH both ends allow."""
    from rpmemfs.transport.verbs import connect

    out: dict[str, Any] = {}
    async with await connect(address, token, lanes=1, timeout=60, src=src) as session:
        region: RemoteRegion = await session.create_pool(DAX_POOL_NAME, DAX_POOL)
        kinds: list[tuple[str, str, RemoteRegion]] = [("devdax read", "apm", replace(region, method="apm"))]
        if region.method == "flush":
            kinds.append(("devdax visibility", "flush", replace(region, native="visibility")))
            if region.native == "persistent":
                kinds.append(("devdax persistent", "flush", region))
        for label, method, r in kinds:
            _log(f"{label}: barriers")
            out[label] = await _method(session, method, iters, r)
    return out


async def _method(session: Any, method: str, iters: int, region: RemoteRegion | None = None
                  ) -> dict[str, Any]:
    local_map = mmap.mmap(-1, POOL)
    buf = memoryview(local_map)
    local = LocalPool(buf, ffi.from_buffer(buf))
    buf[:] = os.urandom(1024) * (POOL // 1024)
    out: dict[str, Any] = {}
    if region is None:  # one pool per method, on the session's lane
        region = await session.create_pool("bench-" + uuid.uuid4().hex[:8], POOL)
    lane = session.lanes[0]

    posting: list[float] = []

    async def timed(ranges: list[tuple[int, int]], n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            ticket = lane.post(region, LocalRanges(local, ranges), method)
            t1 = time.perf_counter()
            await lane.wait(ticket)
            times.append((time.perf_counter() - t0) * 1e6)
            posting.append((t1 - t0) * 1e6)
        return times

    await timed([(0, 4 * KIB)], 20)  # warm-up: first touches, registration
    for label, ranges, n in (
        ("1x4K", [(8 * MIB, 4 * KIB)], iters),
        ("16x4K", [(8 * MIB + i * 8 * KIB, 4 * KIB) for i in range(16)], iters),
    ):
        posting.clear()
        t = sorted(await timed(ranges, n))
        out[label] = {"p50_us": round(percentile(t, 50), 1), "p99_us": round(percentile(t, 99), 1),
                      # Python building and posting the chain, inside p50
                      "post_p50_us": round(percentile(sorted(posting), 50), 1)}
    n1m = max(16, iters // 8)
    t = await timed([(16 * MIB, MIB)], n1m)
    out["1x1M"] = {"MBps": round(n1m * MIB / (sum(t) / 1e6) / 1e6, 1),
                   "p50_us": round(percentile(sorted(t), 50), 1)}
    t0 = time.perf_counter()
    rounds = max(4, iters // 64)
    for _ in range(rounds):
        tickets = [lane.post(region, LocalRanges(local, [(32 * MIB + i * 4 * KIB, 4 * KIB)]), method)
                   for i in range(64)]
        for ticket in tickets:
            await lane.wait(ticket)
    out["pipelined 4K"] = {"barriers_per_s": round(rounds * 64 / (time.perf_counter() - t0))}
    out["lane"] = {"flushes": lane.stats.flushes, "batches": lane.stats.batches}
    return out


def native_flush(dev: str) -> str:
    """Whether this rdma-core and the device offer native RDMA FLUSH."""
    try:
        from rpmemfs.transport import rdma
    except ImportError:
        return "pyverbs missing"
    if not rdma.qpex_has_flush():
        return "not offered by this rdma-core (pyverbs has no QPEx.wr_flush: rdma-core 45+ has)"
    ctx = rdma.Context(name=dev)
    try:
        if not rdma.flush_access(ctx):
            return f"not offered by {dev} (no FLUSH_GLOBAL capability: Linux 6.2+ rxe has it)"
    finally:
        ctx.close()
    return "offered: measured as method 'flush'"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rpmemfs.tools.bench.verbs",
                                description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    p.add_argument("--target-spin-us", type=int, default=None, metavar="US",
                   help="the targets' --spin-us (default: theirs)")
    args = p.parse_args(argv)
    ip_a, ip_b = os.environ.get("RXE_IP_A"), os.environ.get("RXE_IP_B")
    dev_a, dev_b = os.environ.get("RXE_DEV_A", "rxe0"), os.environ.get("RXE_DEV_B", "rxe1")
    if not (ip_a and ip_b):
        print("rpmemfs: bench verbs needs RXE_IP_A and RXE_IP_B (run scripts/bench-verbs.sh)",
              file=sys.stderr)
        return 2
    results: dict[str, Any] = {"iterations": args.iterations, "native_flush": native_flush(dev_a),
                               "target_spin_us": args.target_spin_us,
                               "initiator_spin_us": os.environ.get("RPMEMFS_VERBS_SPIN_US", "default")}
    _log("perftest floor")
    results["perftest"] = {
        "ib_write_lat 4K": perftest("ib_write_lat", 4096, 1000, dev_a, dev_b, ip_b),
        "ib_read_lat 8B": perftest("ib_read_lat", 8, 1000, dev_a, dev_b, ip_b),
        "ib_write_bw 1M": perftest("ib_write_bw", MIB, 200, dev_a, dev_b, ip_b),
    }
    work = Path(tempfile.mkdtemp(prefix="rpmemfs-bench-verbs-", dir="/dev/shm"))
    targets: list[TargetProcess] = []
    try:
        token_file = work / "token"
        token_file.write_text(uuid.uuid4().hex + "\n")
        token_file.chmod(0o600)
        token = read_token_file(str(token_file))
        for method in ("apm", "gpspm"):
            d = work / method
            d.mkdir()
            extra = [] if args.target_spin_us is None else ["--spin-us", str(args.target_spin_us)]
            t = TargetProcess(d, listen=f"{ip_b}:0", token_file=token_file, pmem="force", persist=method,
                              log_path=work / f"{method}.log", log_level="warning", extra=extra)
            t.start(timeout=300)
            targets.append(t)
            results.update(trio.run(_methods, method, t.address, token, ip_a, args.iterations))
        devs = [d for d in os.environ.get("RPMEMFS_DAX_DEVS", "").split(",") if d]
        results["devdax"] = devs[0] if devs else "none (no device DAX in this VM: VM_NVDIMM_MODE)"
        if devs:
            d = work / "devdax"
            d.mkdir()
            t = TargetProcess(d, listen=f"{ip_b}:0", token_file=token_file,
                              extra=["--pool-dev", f"{DAX_POOL_NAME}={devs[0]}", *extra],
                              log_path=work / "devdax.log", log_level="warning")
            t.start(timeout=300)
            targets.append(t)
            results.update(trio.run(_devdax, t.address, token, ip_a, args.iterations))
    finally:
        for t in targets:
            t.close()
        shutil.rmtree(work, ignore_errors=True)
    pt = results["perftest"]
    floor = pt["ib_write_lat 4K"]["typical_us"] + pt["ib_read_lat 8B"]["typical_us"]
    apm, gpspm = results["apm"], results["gpspm"]
    results["ratios"] = {
        "apm 1x4K / (ib_write_lat 4K + ib_read_lat 8B)": round(apm["1x4K"]["p50_us"] / floor, 2),
        "gpspm 1x4K / apm 1x4K": round(gpspm["1x4K"]["p50_us"] / apm["1x4K"]["p50_us"], 2),
        "apm 16x4K / apm 1x4K": round(apm["16x4K"]["p50_us"] / apm["1x4K"]["p50_us"], 2),
        "apm 1x1M MB/s / ib_write_bw": round(apm["1x1M"]["MBps"] / pt["ib_write_bw 1M"]["bw_avg_MBps"], 2),
    }
    if "flush" in results:
        results["ratios"]["flush 1x4K / apm 1x4K"] = round(
            results["flush"]["1x4K"]["p50_us"] / apm["1x4K"]["p50_us"], 2)
        results["ratios"]["flush 1x4K / (ib_write_lat 4K + ib_read_lat 8B)"] = round(
            results["flush"]["1x4K"]["p50_us"] / floor, 2)
    dax = {k: results[k]["1x4K"]["p50_us"] for k in ("devdax read", "devdax visibility",
                                                    "devdax persistent") if k in results}
    if "devdax persistent" in dax:
        results["ratios"]["devdax persistent 1x4K / devdax read 1x4K"] = round(
            dax["devdax persistent"] / dax["devdax read"], 2)
        results["ratios"]["devdax persistent 1x4K / devdax visibility 1x4K"] = round(
            dax["devdax persistent"] / dax["devdax visibility"], 2)
    if "devdax read" in dax:
        results["ratios"]["devdax read 1x4K / apm 1x4K (force)"] = round(
            dax["devdax read"] / apm["1x4K"]["p50_us"], 2)
    print(json.dumps(results, indent=2))
    if args.json:
        safeopen.write_text(args.json, json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
