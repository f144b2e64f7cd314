"""`rpmemfs soak`: writers doing write + fsync against two replicas while target daemons are
killed and restarted at random; then every acknowledged write is checked everywhere.

Each writer process owns its files and journals every write whose fsync returned (file,
offset, length, the seed of its bytes) to a journal outside the mount, fsynced. At the end
the journals are replayed into a model of every file, and the model is compared with the
local pool mounted again and with each replica's pool (a copy, mounted on its own with the
targets stopped); `rpmemfs verify` must be clean too.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from argparse import Namespace, RawDescriptionHelpFormatter
from pathlib import Path
from typing import Any

from rpmemfs import safeopen
from rpmemfs.cliparse import ArgumentParser
from rpmemfs.progress import Notes
from rpmemfs.replica import ReplicaState
from rpmemfs.tools.processes import MountProcess, SpawnError, TargetProcess, run_rpmemfs

FILES_PER_WRITER = 4
FILE_SPAN = 1 << 20

_WRITER = r"""
import hashlib, os, random, sys
mnt, journal, wid, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rng = random.Random(wid)
j = os.open(journal, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
fds = [os.open(os.path.join(mnt, f"w{wid}-{k}"), os.O_CREAT | os.O_RDWR, 0o644) for k in range(FILES)]
op = 0
while not os.path.exists(stop):
    k = rng.randrange(FILES)
    off = rng.randrange(SPAN // 512) * 512
    length = rng.choice([512, 4096, 4096, 20000, 65536])
    seed = wid * 1_000_000_000 + op
    data = random.Random(seed).randbytes(length)
    os.pwrite(fds[k], data, off)
    try:
        os.fsync(fds[k])
    except OSError as e:
        os.write(j, f"FAIL {k} {off} {length} {seed} {e.errno}\n".encode())
        os.fsync(j)
        op += 1
        continue
    os.write(j, f"OK {k} {off} {length} {seed}\n".encode())
    os.fsync(j)
    op += 1
""".replace("FILES", str(FILES_PER_WRITER)).replace("SPAN", str(FILE_SPAN))


_log = Notes("soak")
MOUNT_TIMEOUT = 120.0


def _mount(pool: Path, path: Path, options: str) -> MountProcess:
    """``pool`` mounted at ``path`` in the foreground, its log beside it (path.log)."""
    mount = MountProcess.rpmemfs(pool, path, options, log_path=path.with_suffix(".log"))
    mount.start(MOUNT_TIMEOUT)
    return mount


def _status(mount: MountProcess) -> dict[str, Any]:
    # (Its exit status says the mount's health: degraded and failing are states, not errors.)
    done = run_rpmemfs("status", mount.mountpoint, "--json", check=False)
    if done.returncode not in (0, 1, 2):
        raise SpawnError(f"rpmemfs status {mount.mountpoint} failed: {(done.stderr or done.stdout).strip()}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _model(journals: list[Path]) -> tuple[dict[str, tuple[bytearray, bytearray]], int, int, int]:
    """Files as the acknowledged writes made them, each with a mask of the bytes that are
    certain (a write whose fsync failed may or may not be there, until a later acknowledged
    write covers it); and the counts of writes, bytes and failed fsyncs."""
    files: dict[str, tuple[bytearray, bytearray]] = {}
    ops = nbytes = failed = 0
    for wid, journal in enumerate(journals):
        for line in journal.read_text().splitlines():
            kind, k, off_s, length_s, seed = line.split()[:5]
            off, length = int(off_s), int(length_s)
            data, mask = files.setdefault(f"w{wid}-{k}", (bytearray(), bytearray()))
            end = off + length
            if len(data) < end:
                data.extend(bytes(end - len(data)))
                mask.extend(b"\x01" * (end - len(mask)))
            if kind == "OK":
                data[off:end] = random.Random(int(seed)).randbytes(length)
                mask[off:end] = b"\x01" * length
                ops += 1
                nbytes += length
            else:
                mask[off:end] = bytes(length)
                failed += 1
    return files, ops, nbytes, failed


def _check(root: Path, files: dict[str, tuple[bytearray, bytearray]], what: str) -> tuple[int, list[str]]:
    """Bytes compared and the problems found."""
    checked = 0
    problems = []
    for name, (want, mask) in files.items():
        try:
            got = bytearray((root / name).read_bytes()[: len(want)])
        except OSError as e:
            problems.append(f"{what}: {name}: {e}")
            continue
        got.extend(bytes(len(want) - len(got)))
        uncertain = [i for i, m in enumerate(mask) if not m] if not all(mask) else []
        for i in uncertain:  # either content is right there
            got[i] = want[i]
        if got != want:
            first = next(i for i in range(len(want)) if got[i] != want[i])
            problems.append(f"{what}: {name} differs from the acknowledged writes at byte {first}")
        checked += len(want) - len(uncertain)
    return checked, problems


def run(args: Namespace) -> dict[str, Any]:
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rpmemfs-soak-", dir="/dev/shm"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    targets: list[TargetProcess] = []
    mount: MountProcess | None = None
    writers: list[subprocess.Popen[bytes]] = []
    report: dict[str, Any] = {"work_dir": str(work), "seconds": args.seconds, "writers": args.writers,
                              "faults": 0, "problems": []}
    try:
        for i in range(2):
            d = work / f"target{i}"
            d.mkdir(exist_ok=True)
            t = TargetProcess(d, pmem="force", persist="apm" if i == 0 else None,
                              log_path=work / f"target{i}.log")
            t.start()
            targets.append(t)
        pool = work / "soak.pool"
        run_rpmemfs("mkfs", pool, "--size", args.pool_size, "--force",
                    *(a for t in targets for a in ("--replica", f"{t.address}/soak")))
        mount = _mount(pool, work / "mnt", "pmem=force,min_replicas=1,replica_timeout=2")
        stop = work / "stop"
        stop.unlink(missing_ok=True)
        journals = [work / f"journal{w}" for w in range(args.writers)]
        for j in journals:
            j.unlink(missing_ok=True)
        for w, j in enumerate(journals):
            writers.append(subprocess.Popen([sys.executable, "-c", _WRITER, str(mount.mountpoint), str(j),
                                             str(w), str(stop)]))
        _log(f"{args.writers} writers, two targets ({', '.join(t.address for t in targets)}), "
             f"{args.seconds} s, a fault every ~{args.kill_every} s")
        t_end = time.monotonic() + args.seconds
        next_fault = time.monotonic() + rng.expovariate(1 / args.kill_every)
        last_progress = time.monotonic()
        while time.monotonic() < t_end:
            if any(p.poll() is not None for p in writers):
                raise SpawnError("a writer died: " + ", ".join(str(p.returncode) for p in writers))
            now = time.monotonic()
            if now >= next_fault and all(r["state"] == ReplicaState.IN_SYNC
                                         for r in _status(mount)["replicas"]):
                # One target down at a time: the policy (min_replicas=1) then always holds.
                i = rng.randrange(2)
                victim = targets[i]
                victim.kill()
                report["faults"] += 1
                time.sleep(rng.uniform(0.2, 2.0))
                again = victim.respawn(log_path=work / f"target{i}-{report['faults']}.log")
                again.start()
                victim.close()
                targets[i] = again
                next_fault = time.monotonic() + rng.expovariate(1 / args.kill_every)
            if now - last_progress > 5:
                last_progress = now
                states = [r["state"] for r in _status(mount)["replicas"]]
                ops = sum(len(j.read_text().splitlines()) for j in journals if j.exists())
                _log(f"{ops} writes acknowledged, {report['faults']} faults, replicas {states}")
            time.sleep(0.05)
        stop.touch()
        for p in writers:
            p.wait(60)
        # Both replicas in sync before the end: a fault just before it needs its resync.
        deadline = time.monotonic() + 90
        while True:
            st = _status(mount)["replicas"]
            if all(r["state"] == ReplicaState.IN_SYNC for r in st) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        report["replica_states"] = [r["state"] for r in st]
        report["resyncs"] = sum(r.get("resyncs", 0) for r in st)
        mount.stop(MOUNT_TIMEOUT)
        mount = None
        files, ops, nbytes, failed = _model(journals)
        report.update(operations=ops, bytes_written=nbytes, failed_fsyncs=failed)
        if failed:
            report["problems"].append(f"{failed} fsyncs failed although one replica was always up")
        verify = run_rpmemfs("verify", pool, check=False)
        if verify.returncode != 0:
            report["problems"].append("rpmemfs verify found differences:\n" + verify.stdout[-2000:])
        checked = 0
        again_mount = _mount(pool, work / "local", "pmem=force,replica_timeout=5")
        try:
            n, problems = _check(again_mount.mountpoint, files, "local pool")
        finally:
            again_mount.stop(MOUNT_TIMEOUT)
        checked += n
        report["problems"] += problems
        for t in targets:
            t.stop()
        for i, t in enumerate(targets):
            copy = work / f"replica{i}.pool"
            shutil.copy(t.pool_dir / "soak", copy)
            alone = _mount(copy, work / f"alone{i}", "pmem=force,min_replicas=0,replica_timeout=1")
            try:
                n, problems = _check(alone.mountpoint, files, f"replica {i}")
            finally:
                alone.stop(MOUNT_TIMEOUT)
            checked += n
            report["problems"] += problems
        report["bytes_checked"] = checked
    finally:
        for p in writers:
            if p.poll() is None:
                p.kill()
        if mount is not None:
            mount.stop(MOUNT_TIMEOUT)
        for t in targets:
            t.close()
    report["result"] = "PASS" if not report["problems"] and report.get("bytes_checked") else "FAIL"
    return report


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="rpmemfs soak", description=__doc__,
                       formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="work directory (default: a new one under /dev/shm)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--writers", type=int, default=3)
    p.add_argument("--pool-size", default="256M")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kill-every", type=float, default=5.0, help="mean seconds between target kills")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    args = p.parse_args(argv)
    if args.writers < 1 or args.seconds <= 0 or args.kill_every <= 0:
        p.error("--writers, --seconds and --kill-every must be positive")
    report = run(args)
    if args.json:
        safeopen.write_text(args.json, json.dumps(report, indent=2))
    print(f"soak: {report.get('operations', 0)} acknowledged writes "
          f"({report.get('bytes_written', 0)} bytes) by {args.writers} writers in {args.seconds:g} s; "
          f"{report['faults']} target kills, {report.get('resyncs', 0)} resyncs; "
          f"{report.get('bytes_checked', 0)} bytes checked on the local pool and both replicas: "
          f"{report['result']}")
    for problem in report["problems"][:20]:
        print(f"  {problem}")
    if not args.keep and not args.dir:
        shutil.rmtree(report["work_dir"], ignore_errors=True)
    return 0 if report["result"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
