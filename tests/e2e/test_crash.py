"""Crash consistency: kill -9 the mount daemon at random moments under a real workload.

The workload runs in a separate Python process (this file run as a script) against the
mount. Before each operation it records an intent line in a journal OUTSIDE the mount, and
after the fsync that makes it durable it records an acknowledgement; every journal line is
flushed and fsynced. All file data is self-describing (`helpers.stamp_block`: file id, file
offset, version), so the verifier can tell where every byte came from.

After each kill: detach, `rpmemfs check` must be clean, remount, and then
  * every acknowledged operation is there, exactly;
  * only the operations after the last acknowledgement may be missing or partly there;
  * no file holds bytes that were never written to that file at that offset (zeros in
    holes/extensions excepted) - no stale data of other or deleted files.

Seeds are printed; rerun one with RPMEMFS_CRASH_SEED=<seed>.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import (  # noqa: E402
    BLOCK,
    Mount,
    assert_check_clean,
    cli,
    describe,
    fsync_path,
    fsync_tree,
    identify,
    snapshot,
    stamp_block,
    stamp_data,
    wait_until,
)

if TYPE_CHECKING:
    from conftest import MakePool, MountPool

MAX_FILES = 12
MAX_BLOCKS = 48
WORKER_MAX_SECONDS = 120.0
ROUNDS = int(os.environ.get("RPMEMFS_CRASH_ROUNDS", "5"))

Op = dict[str, Any]


# =============================================================== the workload process


class Journal:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, rec: Op) -> None:
        self.f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def small_content(key: int, ver: int, length: int) -> bytes:
    unit = f"<key {key} version {ver}>".encode()
    return (unit * (length // len(unit) + 1))[:length]


def worker_files(root: Path, journal_path: Path, seed: int, fid_base: int) -> None:
    """Random writes/appends/truncates/creates/renames/unlinks, each batch fsynced."""
    rng = random.Random(seed)
    j = Journal(journal_path)
    dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    files: dict[int, dict[str, Any]] = {}  # fid -> {"name", "size"}
    next_fid = fid_base
    seq = 0
    deadline = time.monotonic() + WORKER_MAX_SECONDS
    j.log({"ready": True})

    def data_op(fid: int, fd: int, afd: int) -> None:
        nonlocal seq
        f = files[fid]
        size = f["size"]
        r = rng.random()
        seq += 1
        if r < 0.15 or size >= MAX_BLOCKS * BLOCK:
            new = rng.randrange(0, MAX_BLOCKS * BLOCK // 2)
            if rng.random() < 0.6:
                new -= new % BLOCK
            j.log({"seq": seq, "op": "truncate", "fid": fid, "size": new})
            os.ftruncate(fd, new)
            f["size"] = new
        elif r < 0.4:
            n = rng.randrange(1, 6)
            j.log({"seq": seq, "op": "write", "fid": fid, "off": size, "n": n, "append": True})
            assert os.write(afd, stamp_data(fid, size, n, seq)) == n * BLOCK
            f["size"] = size + n * BLOCK
        else:
            n = rng.randrange(1, 9)
            top = min(MAX_BLOCKS - n, size // BLOCK + 3)
            off = rng.randrange(0, max(1, top)) * BLOCK
            j.log({"seq": seq, "op": "write", "fid": fid, "off": off, "n": n})
            assert os.pwrite(fd, stamp_data(fid, off, n, seq), off) == n * BLOCK
            f["size"] = max(size, off + n * BLOCK)

    while time.monotonic() < deadline:
        r = rng.random()
        if len(files) < 3 or (r < 0.15 and len(files) < MAX_FILES):
            fid = next_fid
            next_fid += 1
            name = f"f{fid}"
            seq += 1
            j.log({"seq": seq, "op": "create", "fid": fid, "name": name})
            fd = os.open(root / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            files[fid] = {"name": name, "size": 0}
            n = rng.randrange(0, 8)
            if n:
                seq += 1
                j.log({"seq": seq, "op": "write", "fid": fid, "off": 0, "n": n})
                os.write(fd, stamp_data(fid, 0, n, seq))
                files[fid]["size"] = n * BLOCK
            os.fsync(fd)
            os.close(fd)
            os.fsync(dirfd)
            j.log({"ack": seq})
        elif r < 0.75:
            fid = rng.choice(sorted(files))
            path = root / files[fid]["name"]
            fd = os.open(path, os.O_RDWR)
            afd = os.open(path, os.O_WRONLY | os.O_APPEND)
            for _ in range(rng.randrange(1, 5)):
                data_op(fid, fd, afd)
            if rng.random() < 0.5:
                os.fsync(fd)
            else:
                os.fdatasync(fd)
            os.close(afd)
            os.close(fd)
            j.log({"ack": seq})
        elif r < 0.9:
            fid = rng.choice(sorted(files))
            old = files[fid]["name"]
            others = [o for o in files if o != fid]
            victim = rng.choice(others) if others and rng.random() < 0.4 else None
            seq += 1
            new = files[victim]["name"] if victim is not None else f"f{fid}.r{seq}"
            j.log({"seq": seq, "op": "rename", "fid": fid, "old": old, "new": new,
                   "victim": victim})
            os.rename(root / old, root / new)
            files[fid]["name"] = new
            if victim is not None:
                del files[victim]
            os.fsync(dirfd)
            j.log({"ack": seq})
        elif len(files) > 3:
            fid = rng.choice(sorted(files))
            seq += 1
            j.log({"seq": seq, "op": "unlink", "fid": fid, "name": files[fid]["name"]})
            os.unlink(root / files[fid]["name"])
            del files[fid]
            os.fsync(dirfd)
            j.log({"ack": seq})


def worker_small(root: Path, journal_path: Path, seed: int) -> None:
    """Many small files: write tmp + fsync + rename over the real name + fsync dir."""
    rng = random.Random(seed)
    j = Journal(journal_path)
    dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    present: set[int] = set()
    news: list[str] = []
    seq = 0
    deadline = time.monotonic() + WORKER_MAX_SECONDS
    j.log({"ready": True})
    while time.monotonic() < deadline:
        r = rng.random()
        seq += 1
        length = rng.randrange(1, 6000)
        if r < 0.7:
            key = rng.randrange(40)
            j.log({"seq": seq, "op": "replace", "key": key, "len": length})
            fd = os.open(root / f"k{key}.tmp", os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
            os.write(fd, small_content(key, seq, length))
            os.fsync(fd)
            os.close(fd)
            os.rename(root / f"k{key}.tmp", root / f"k{key}")
            present.add(key)
        elif r < 0.9 and len(news) > 60:
            name = news.pop(rng.randrange(len(news)))
            j.log({"seq": seq, "op": "delnew", "name": name})
            os.unlink(root / name)
        elif r < 0.9:
            j.log({"seq": seq, "op": "new", "name": f"n{seq}", "len": length})
            fd = os.open(root / f"n{seq}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(fd, small_content(100_000 + seq, seq, length))
            os.fsync(fd)
            os.close(fd)
            news.append(f"n{seq}")
        elif present:
            key = rng.choice(sorted(present))
            j.log({"seq": seq, "op": "unlink", "key": key})
            os.unlink(root / f"k{key}")
            present.discard(key)
        else:
            continue
        os.fsync(dirfd)
        j.log({"ack": seq})


def worker_stream(root: Path, journal_path: Path) -> None:
    """Rewrite one file sequentially, again and again (truncate, write, fsync)."""
    j = Journal(journal_path)
    fd = os.open(root / "stream", os.O_CREAT | os.O_RDWR, 0o644)
    j.log({"ready": True})
    deadline = time.monotonic() + WORKER_MAX_SECONDS
    ver = 0
    while time.monotonic() < deadline:
        ver += 1
        j.log({"seq": ver, "op": "pass"})
        os.ftruncate(fd, 0)
        for i in range(1200):
            os.pwrite(fd, stamp_block(2, i * BLOCK, ver), i * BLOCK)
        os.fsync(fd)
        j.log({"ack": ver})

NPARENTS = 4
NDIRS = 5


def worker_dirs(root: Path, journal_path: Path, seed: int) -> None:
    """Directories moved between parents, subdirectories made and removed, all fsynced."""
    rng = random.Random(seed)
    j = Journal(journal_path)
    j.log({"ready": True})
    seq = 1
    j.log({"seq": seq, "op": "setup"})
    for p in range(NPARENTS):
        os.mkdir(root / f"p{p}")
    for i in range(NDIRS):
        os.mkdir(root / "p0" / f"m{i}")
        (root / "p0" / f"m{i}" / "id").write_bytes(f"m{i}".encode())
        fsync_path(root / "p0" / f"m{i}" / "id")
        fsync_path(root / "p0" / f"m{i}")
    for p in range(NPARENTS):
        fsync_path(root / f"p{p}")
    fsync_path(root)
    j.log({"ack": seq})
    where = dict.fromkeys(range(NDIRS), 0)
    subs: dict[int, set[str]] = {i: set() for i in range(NDIRS)}
    pfds = [os.open(root / f"p{p}", os.O_RDONLY | os.O_DIRECTORY) for p in range(NPARENTS)]
    deadline = time.monotonic() + WORKER_MAX_SECONDS
    while time.monotonic() < deadline:
        i = rng.randrange(NDIRS)
        r = rng.random()
        seq += 1
        here = root / f"p{where[i]}" / f"m{i}"
        if r < 0.6:
            a = where[i]
            b = rng.choice([p for p in range(NPARENTS) if p != a])
            j.log({"seq": seq, "op": "mvdir", "dir": i, "from": a, "to": b})
            os.rename(here, root / f"p{b}" / f"m{i}")
            os.fsync(pfds[a])
            os.fsync(pfds[b])
            where[i] = b
        elif (r < 0.8 or not subs[i]) and len(subs[i]) < 8:
            name = f"s{seq}"
            j.log({"seq": seq, "op": "mkdir", "dir": i, "name": name})
            os.mkdir(here / name)
            fsync_path(here)
            subs[i].add(name)
        else:
            name = rng.choice(sorted(subs[i]))
            j.log({"seq": seq, "op": "rmdir", "dir": i, "name": name})
            os.rmdir(here / name)
            fsync_path(here)
            subs[i].discard(name)
        j.log({"ack": seq})


def worker_main(argv: list[str]) -> int:
    mode, root, journal = argv[0], Path(argv[1]), Path(argv[2])
    try:
        if mode == "files":
            worker_files(root, journal, int(argv[3]), int(argv[4]))
        elif mode == "small":
            worker_small(root, journal, int(argv[3]))
        elif mode == "stream":
            worker_stream(root, journal)
        elif mode == "dirs":
            worker_dirs(root, journal, int(argv[3]))
        else:
            raise SystemExit(f"unknown mode {mode}")
    except OSError as exc:
        # Expected once the daemon is killed (ENOTCONN/ECONNABORTED); the test decides.
        print(f"worker stopped: {exc!r}", file=sys.stderr, flush=True)
        return 3
    return 0


# ================================================================ test-side machinery


def load_journal(path: Path) -> tuple[list[Op], int]:
    """(operations in order, highest acknowledged seq). A torn last line is ignored."""
    lines = path.read_text(encoding="utf-8").split("\n")
    ops: list[Op] = []
    acked = 0
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            assert i == len(lines) - 1, f"corrupt journal line {i}: {line!r}"
            continue
        if "ack" in rec:
            acked = max(acked, rec["ack"])
        elif "seq" in rec:
            ops.append(rec)
    return ops, acked


def start_worker(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, __file__, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )


def journal_acks(path: Path) -> int:
    try:
        return load_journal(path)[1]
    except FileNotFoundError:
        return 0


def crash_round(
    m: Mount, worker: subprocess.Popen[bytes], journal: Path, wlog: Path, delay: float,
    context: str,
) -> None:
    """Let the worker get going, SIGKILL the daemon, stop the worker, detach, check."""
    got_going = wait_until(lambda: journal_acks(journal) > 0 or worker.poll() is not None, 60)
    assert worker.poll() is None, (
        f"{context}: workload died before the kill (exit {worker.returncode})\n"
        f"{wlog.read_text(errors='replace')}\n--- daemon ---\n{m.output()}"
    )
    assert got_going, f"{context}: workload acknowledged nothing within 60 s"
    time.sleep(delay)
    assert worker.poll() is None, (
        f"{context}: workload failed before the kill (exit {worker.returncode})\n"
        f"{wlog.read_text(errors='replace')}\n--- daemon ---\n{m.output()}"
    )
    m.kill_daemon()
    # The worker must be gone before the dead mount is detached, or it would write
    # into the directory underneath.
    worker.kill()
    worker.wait(timeout=30)
    m.detach()
    res = cli("check", m.pool)
    assert res.returncode == 0, f"{context}: check after kill -9 is not clean\n{describe(res)}"
    m.start()


def mismatch(what: str, obs: bytes, expected: bytes, off: int) -> str:
    bs = off - off % BLOCK
    return (
        f"{what}: byte {off} is {obs[off]:#04x}; block at {bs} holds "
        f"{identify(obs[bs:bs + BLOCK])}; expected {identify(expected[bs:bs + BLOCK])}"
    )


def check_content(what: str, obs: bytes, base: bytes, fid: int, pend: list[Op]) -> str | None:
    """OBS must be BASE (the acknowledged content) changed by any part of PEND (the
    unacknowledged writes/truncates of this file): every byte is the acknowledged byte, a
    byte of a pending write at that offset, or zero where a pending truncate or an extension
    may have left a hole. Returns an error description or None."""
    if not pend:
        if obs == base:
            return None
        if len(obs) != len(base):
            return f"{what}: size {len(obs)}, acknowledged size {len(base)} (no pending ops)"
        off = next(i for i in range(len(obs)) if obs[i] != base[i])
        return mismatch(f"{what} (no pending ops)", obs, base, off)
    writes: list[tuple[int, bytes]] = []
    sizes = [len(base)]
    cur = len(base)
    trunc_min: int | None = None
    for op in pend:
        if op["op"] == "write":
            data = stamp_data(fid, op["off"], op["n"], op["seq"])
            writes.append((op["off"], data))
            cur = max(cur, op["off"] + len(data))
        elif op["op"] == "truncate":
            cur = op["size"]
            trunc_min = op["size"] if trunc_min is None else min(trunc_min, op["size"])
        sizes.append(cur)
    if not min(sizes) <= len(obs) <= max(sizes):
        return f"{what}: size {len(obs)} outside the possible range {min(sizes)}..{max(sizes)}"
    for bs in range(0, len(obs), BLOCK):
        be = min(bs + BLOCK, len(obs))
        if be <= len(base) and obs[bs:be] == base[bs:be]:
            continue
        for i in range(bs, be):
            v = obs[i]
            if i < len(base) and base[i] == v:
                continue
            if v == 0 and (i >= len(base) or (trunc_min is not None and i >= trunc_min)):
                continue
            if any(o <= i < o + len(d) and d[i - o] == v for o, d in writes):
                continue
            pend_desc = ", ".join(
                f"{p['op']}@{p.get('off', p.get('size'))}x{p.get('n', '')}#{p['seq']}"
                for p in pend
            )
            return mismatch(f"{what} (pending: {pend_desc})", obs, base, i)
    return None


@dataclass
class FileModel:
    name: str
    data: bytearray


def replay(ops: list[Op]) -> tuple[dict[int, FileModel], dict[str, int]]:
    files: dict[int, FileModel] = {}
    names: dict[str, int] = {}
    for op in ops:
        kind = op["op"]
        if kind == "create":
            files[op["fid"]] = FileModel(op["name"], bytearray())
            names[op["name"]] = op["fid"]
        elif kind == "write":
            d = files[op["fid"]].data
            data = stamp_data(op["fid"], op["off"], op["n"], op["seq"])
            end = op["off"] + len(data)
            if end > len(d):
                d.extend(bytes(end - len(d)))
            d[op["off"] : end] = data
        elif kind == "truncate":
            d = files[op["fid"]].data
            if op["size"] < len(d):
                del d[op["size"] :]
            else:
                d.extend(bytes(op["size"] - len(d)))
        elif kind == "rename":
            names.pop(op["old"])
            if op["victim"] is not None:
                files.pop(op["victim"])
            names[op["new"]] = op["fid"]
            files[op["fid"]].name = op["new"]
        elif kind == "unlink":
            names.pop(op["name"])
            files.pop(op["fid"])
    return files, names


def verify_files_round(root: Path, journal: Path) -> list[str]:
    ops, acked = load_journal(journal)
    done = [o for o in ops if o["seq"] <= acked]
    pend = [o for o in ops if o["seq"] > acked]
    files, names = replay(done)
    _files_all, names_all = replay(ops)
    pend_data: dict[int, list[Op]] = {}
    for o in pend:
        if o["op"] in ("write", "truncate"):
            pend_data.setdefault(o["fid"], []).append(o)
    pend_rename = next((o for o in pend if o["op"] == "rename"), None)
    errors: list[str] = []
    observed = set(os.listdir(root))

    def content_ok(name: str, fid: int) -> str | None:
        base = bytes(files[fid].data) if fid in files else b""
        obs = (root / name).read_bytes()
        return check_content(f"{root.name}/{name} (file id {fid})", obs, base, fid,
                             pend_data.get(fid, []))

    for name in sorted(set(names) | set(names_all) | observed):
        a, b = names.get(name), names_all.get(name)
        present = name in observed
        if a is None and b is None:
            errors.append(f"{root.name}/{name}: unexpected file (never created there)")
        elif a is not None and a == b:
            if not present:
                errors.append(f"{root.name}/{name}: acknowledged file (id {a}) is missing")
            elif err := content_ok(name, a):
                errors.append(err)
        elif present:
            cands = [fid for fid in (a, b) if fid is not None]
            errs = [content_ok(name, fid) for fid in cands]
            if all(errs):
                errors.extend(e for e in errs if e)
        elif a is not None and pend_rename is not None and name == pend_rename["new"]:
            errors.append(f"{root.name}/{name}: rename target lost both old and new file")
    if pend_rename is not None:
        old, new, fid = pend_rename["old"], pend_rename["new"], pend_rename["fid"]
        if old not in observed and (
            new not in observed or content_ok(new, fid) is not None
        ):
            errors.append(f"{root.name}: pending rename {old} -> {new} lost file id {fid}")
        victim = pend_rename["victim"]
        if old in observed and new in observed and (
            victim is None or content_ok(new, victim) is not None
        ):
            errors.append(f"{root.name}: rename {old} -> {new} visible under both names")
    return errors


def verify_small_round(root: Path, journal: Path) -> list[str]:
    ops, acked = load_journal(journal)
    done = [o for o in ops if o["seq"] <= acked]
    pend = next((o for o in ops if o["seq"] > acked), None)
    keys: dict[int, Op] = {}
    news: dict[str, Op] = {}
    for o in done:
        if o["op"] == "replace":
            keys[o["key"]] = o
        elif o["op"] == "unlink":
            keys.pop(o["key"])
        elif o["op"] == "new":
            news[o["name"]] = o
        elif o["op"] == "delnew":
            del news[o["name"]]
    errors: list[str] = []
    observed = set(os.listdir(root))
    allowed = {f"k{k}" for k in keys} | set(news)
    if pend is not None:
        if pend["op"] == "replace":
            allowed |= {f"k{pend['key']}", f"k{pend['key']}.tmp"}
        elif pend["op"] == "new":
            allowed.add(pend["name"])
    for name in sorted(observed - allowed):
        errors.append(f"{root.name}/{name}: unexpected file")

    def prefix_ok(obs: bytes, want: bytes) -> bool:
        return len(obs) <= len(want) and all(v in (0, w) for v, w in zip(obs, want, strict=False))

    for k in range(40):
        name = f"k{k}"
        acked_c = small_content(k, keys[k]["seq"], keys[k]["len"]) if k in keys else None
        pend_c = None
        if pend is not None and pend["op"] == "replace" and pend["key"] == k:
            pend_c = small_content(k, pend["seq"], pend["len"])
        obs = (root / name).read_bytes() if name in observed else None
        unlink_pending = pend is not None and pend["op"] == "unlink" and pend["key"] == k
        if acked_c is not None and obs is None and not unlink_pending:
            errors.append(f"{name}: acknowledged version {keys[k]['seq']} missing")
        elif obs is not None and obs not in (acked_c, pend_c):
            errors.append(
                f"{name}: content {obs[:40]!r}... (len {len(obs)}) is neither the acknowledged "
                f"version nor the pending one"
            )
        tmp = f"k{k}.tmp"
        if tmp in observed:
            tobs = (root / tmp).read_bytes()
            if pend_c is None or not prefix_ok(tobs, pend_c):
                errors.append(f"{tmp}: unexpected content {tobs[:40]!r}")
            if obs is not None and pend_c is not None and obs == pend_c:
                errors.append(f"{name}: rename visible but {tmp} still exists")
    for name, o in news.items():
        want = small_content(100_000 + o["seq"], o["seq"], o["len"])
        if pend is not None and pend["op"] == "delnew" and pend["name"] == name:
            if name in observed and (root / name).read_bytes() != want:
                errors.append(f"{name}: file being deleted has changed content")
        elif name not in observed:
            errors.append(f"{name}: acknowledged new file missing")
        elif (root / name).read_bytes() != want:
            errors.append(f"{name}: content differs from what was acknowledged")
    if pend is not None and pend["op"] == "new" and pend["name"] in observed:
        want = small_content(100_000 + pend["seq"], pend["seq"], pend["len"])
        if not prefix_ok((root / pend["name"]).read_bytes(), want):
            errors.append(f"{pend['name']}: pending new file holds foreign bytes")
    return errors


def verify_dirs_round(root: Path, journal: Path) -> list[str]:
    ops, acked = load_journal(journal)
    assert acked >= 1, "setup was not acknowledged"
    where = dict.fromkeys(range(NDIRS), 0)
    subs: dict[int, set[str]] = {i: set() for i in range(NDIRS)}
    pend: Op | None = None
    for o in ops:
        if o["seq"] > acked:
            pend = o
            break
        if o["op"] == "mvdir":
            where[o["dir"]] = o["to"]
        elif o["op"] == "mkdir":
            subs[o["dir"]].add(o["name"])
        elif o["op"] == "rmdir":
            subs[o["dir"]].discard(o["name"])
    errors: list[str] = []
    parents = [f"p{p}" for p in range(NPARENTS)]
    if sorted(os.listdir(root)) != parents:
        errors.append(f"{root.name}: top level is {sorted(os.listdir(root))}")
        return errors
    listing = {p: set(os.listdir(root / f"p{p}")) for p in range(NPARENTS)}
    for p in range(NPARENTS):
        nl = os.stat(root / f"p{p}").st_nlink
        if nl != 2 + len(listing[p]):
            errors.append(f"p{p}: st_nlink {nl} with {len(listing[p])} subdirectories")
    for i in range(NDIRS):
        locs = [p for p in range(NPARENTS) if f"m{i}" in listing[p]]
        allowed = [[where[i]]]
        if pend is not None and pend["op"] == "mvdir" and pend["dir"] == i:
            allowed.append([pend["to"]])
        if locs not in allowed:
            errors.append(f"m{i}: found in parents {locs}, expected one of {allowed}")
            continue
        d = root / f"p{locs[0]}" / f"m{i}"
        if (d / "id").read_bytes() != f"m{i}".encode():
            errors.append(f"m{i}: id file damaged")
        if os.stat(d / "..").st_ino != os.stat(root / f"p{locs[0]}").st_ino:
            errors.append(f"m{i}: '..' does not point at its parent p{locs[0]}")
        seen = set(os.listdir(d)) - {"id"}
        ok = [subs[i]]
        if pend is not None and pend.get("dir") == i and pend["op"] == "mkdir":
            ok.append(subs[i] | {pend["name"]})
        if pend is not None and pend.get("dir") == i and pend["op"] == "rmdir":
            ok.append(subs[i] - {pend["name"]})
        if seen not in ok:
            errors.append(f"m{i}: subdirectories {sorted(seen)}, expected one of {ok}")
        nl = os.stat(d).st_nlink
        if nl != 2 + len(seen):
            errors.append(f"m{i}: st_nlink {nl} with {len(seen)} subdirectories")
    return errors


def crash_seed() -> int:
    env = os.environ.get("RPMEMFS_CRASH_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(1 << 32)
    print(f"crash test seed: {seed} (rerun with RPMEMFS_CRASH_SEED={seed})")
    return seed


def run_rounds(
    m: Mount, work_dir: Path, mode: str, rounds: int, seed: int,
) -> int:
    """Kill/recover ROUNDS times; each round works in its own directory, and the
    directories of earlier rounds (fsynced after their verification) must not change."""
    rng = random.Random(seed)
    settled: dict[str, Any] = {}
    total_acked = 0
    for rnd in range(rounds):
        context = f"seed {seed}, round {rnd}"
        d = m.path / f"{mode}{rnd}"
        d.mkdir()
        fsync_path(d)
        fsync_path(m.path)
        journal = work_dir / f"journal-{mode}{rnd}.jsonl"
        wlog = work_dir / f"worker-{mode}{rnd}.log"
        wseed = rng.randrange(1 << 32)
        args = [mode, str(d), str(journal), str(wseed)]
        if mode == "files":
            args.append(str(1000 * (rnd + 1)))
        worker = start_worker(args, wlog)
        try:
            crash_round(m, worker, journal, wlog, rng.uniform(0.2, 2.0), context)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        total_acked += load_journal(journal)[1]
        verify = {
            "files": verify_files_round, "small": verify_small_round, "dirs": verify_dirs_round,
        }[mode]
        errors = verify(d, journal)
        assert not errors, f"{context}:\n" + "\n".join(errors[:20])
        for prev, snap in settled.items():
            now = snapshot(m.path / prev, meta=False)
            assert now == snap, f"{context}: directory {prev} changed after a later crash"
        fsync_tree(d)
        settled[d.name] = snapshot(d, meta=False)
    return total_acked


# ========================================================================== the tests


@pytest.mark.parametrize(
    "options", ["pmem=force", "pmem=force,writeback_cache", "pmem=msync"]
)
def test_crash_random_workload(
    make_pool: MakePool, mount_pool: MountPool, work_dir: Path, options: str
) -> None:
    seed = crash_seed()
    m = mount_pool(make_pool("64M"), options=options)
    acked = run_rounds(m, work_dir, "files", ROUNDS, seed)
    assert acked > 0
    m.unmount()
    assert_check_clean(m.pool)


def test_crash_small_files_and_renames(
    make_pool: MakePool, mount_pool: MountPool, work_dir: Path
) -> None:
    seed = crash_seed()
    # a small pool has small log areas: checkpoints happen during the workload
    m = mount_pool(make_pool("16M"))
    acked = run_rounds(m, work_dir, "small", ROUNDS, seed)
    assert acked > 0
    m.unmount()
    assert_check_clean(m.pool)


def test_crash_directory_renames(
    make_pool: MakePool, mount_pool: MountPool, work_dir: Path
) -> None:
    seed = crash_seed()
    m = mount_pool(make_pool("16M"))
    acked = run_rounds(m, work_dir, "dirs", ROUNDS, seed)
    assert acked > 0
    m.unmount()
    assert_check_clean(m.pool)


def test_crash_never_exposes_deleted_file_data(
    make_pool: MakePool, mount_pool: MountPool, work_dir: Path
) -> None:
    """Blocks freed by a deleted file get reused by a file being written when the daemon
    dies: the new file may show its own data or zeros, never the deleted file's bytes."""
    seed = crash_seed()
    rng = random.Random(seed)
    m = mount_pool(make_pool("16M"))
    for rnd in range(3):
        old = m.path / "old"
        fd = os.open(old, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        for i in range(1800):  # 7 MiB of stamped blocks of "file id 1"
            os.write(fd, stamp_block(1, i * BLOCK, rnd + 1))
        os.fsync(fd)
        os.close(fd)
        os.unlink(old)
        fsync_path(m.path)
        journal = work_dir / f"journal-stream{rnd}.jsonl"
        wlog = work_dir / f"worker-stream{rnd}.log"
        worker = start_worker(["stream", str(m.path), str(journal)], wlog)
        try:
            crash_round(m, worker, journal, wlog, rng.uniform(0.2, 1.5), f"seed {seed} round {rnd}")
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        ops, acked = load_journal(journal)
        started = max((o["seq"] for o in ops), default=0)
        assert "old" not in os.listdir(m.path)
        obs = (m.path / "stream").read_bytes()
        assert len(obs) <= 1200 * BLOCK
        for bs in range(0, len(obs), BLOCK):
            blk = obs[bs : bs + BLOCK]
            cands = [stamp_block(2, bs, v) for v in range(max(1, acked), started + 1)]
            if not any(blk):
                continue
            if any(blk == c[: len(blk)] for c in cands):
                continue
            for i, v in enumerate(blk):
                assert v == 0 or any(c[i] == v for c in cands), (
                    f"seed {seed} round {rnd}: stream offset {bs + i} holds "
                    f"{identify(blk)} (acked pass {acked}, started {started})"
                )
        assert len(obs) % BLOCK == 0
        if acked and started == acked:
            # nothing after the acknowledged pass: it must be there, complete
            want = b"".join(stamp_block(2, i * BLOCK, acked) for i in range(1200))
            assert obs == want, f"seed {seed} round {rnd}: acknowledged pass {acked} damaged"
        os.unlink(m.path / "stream")
        fsync_path(m.path)
    m.unmount()
    assert_check_clean(m.pool)


@pytest.mark.parametrize("options", ["pmem=force", "pmem=force,writeback_cache"])
def test_sync_points_survive_kill9(
    make_pool: MakePool, mount_pool: MountPool, options: str
) -> None:
    """fsync, fdatasync, msync(MS_SYNC) and fsync of the directory are durability points."""
    m = mount_pool(make_pool("32M"), options=options)
    r = m.path
    os.mkdir(r / "dir")
    fd = os.open(r / "dir" / "fsynced", os.O_CREAT | os.O_WRONLY, 0o640)
    os.write(fd, b"F" * 10000)
    os.fsync(fd)
    os.close(fd)
    fd = os.open(r / "dir" / "fdatasynced", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"D" * 20000)
    os.fdatasync(fd)
    os.close(fd)
    (r / "mapped").write_bytes(b"\0" * 3 * BLOCK)
    fsync_path(r / "mapped")
    fd = os.open(r / "mapped", os.O_RDWR)
    with mmap.mmap(fd, 3 * BLOCK) as mm:
        mm[100:110] = b"MSYNC-DATA"
        mm[2 * BLOCK : 2 * BLOCK + 4] = b"LAST"
        mm.flush()
    os.close(fd)
    os.symlink("dir/fsynced", r / "symlink")
    os.link(r / "dir" / "fsynced", r / "hardlink")
    os.rename(r / "dir" / "fdatasynced", r / "renamed")
    fsync_path(r / "dir")
    fsync_path(r)
    fd = os.open(r / "truncated", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"T" * 50000)
    os.ftruncate(fd, 123)
    os.fsync(fd)
    os.close(fd)
    fsync_path(r)

    m.kill9()
    assert_check_clean(m.pool)
    m.start()
    assert (r / "dir" / "fsynced").read_bytes() == b"F" * 10000
    assert (r / "renamed").read_bytes() == b"D" * 20000
    assert not (r / "dir" / "fdatasynced").exists()
    mapped = (r / "mapped").read_bytes()
    assert mapped[100:110] == b"MSYNC-DATA" and mapped[2 * BLOCK : 2 * BLOCK + 4] == b"LAST"
    assert mapped.count(0) == 3 * BLOCK - 14
    assert os.readlink(r / "symlink") == "dir/fsynced"
    assert os.stat(r / "hardlink").st_nlink == 2
    assert (r / "hardlink").read_bytes() == b"F" * 10000
    assert (r / "truncated").read_bytes() == b"T" * 123
    assert os.stat(r / "dir" / "fsynced").st_mode & 0o777 == 0o640


def test_kill9_idle_and_repeated(make_pool: MakePool, mount_pool: MountPool) -> None:
    """kill -9 right after mounting, and twice in a row, leaves a clean, mountable pool."""
    m = mount_pool(make_pool("16M"))
    (m.path / "keep").write_bytes(b"keep" * 1000)
    fsync_path(m.path / "keep")
    fsync_path(m.path)
    for _ in range(3):
        m.kill9()
        assert_check_clean(m.pool)
        m.start()
        assert (m.path / "keep").read_bytes() == b"keep" * 1000
    big = m.path / "big"
    data = stamp_data(7, 0, 512, 1)
    with open(big, "wb") as f:
        f.write(data)
    # no fsync: after the kill the file may be absent or partial, but the pool is clean
    # and whatever is there is zeros or this file's own bytes
    m.kill9()
    assert_check_clean(m.pool)
    m.start()
    assert (m.path / "keep").read_bytes() == b"keep" * 1000
    if big.exists():
        err = check_content("big", big.read_bytes(), b"", 7,
                            [{"op": "write", "off": 0, "n": 512, "seq": 1}])
        assert err is None, err


def test_enotconn_after_kill_then_detach(make_pool: MakePool, mount_pool: MountPool) -> None:
    """Sanity of the harness itself: a killed daemon leaves a dead mount until detached."""
    m = mount_pool(make_pool("16M"))
    m.kill_daemon()
    try:
        os.listdir(m.path)
    except OSError as exc:
        assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    else:
        raise AssertionError("listing a dead FUSE mount succeeded")
    m.detach()
    assert os.listdir(m.path) == []  # the empty directory underneath
    m.start()
    assert os.listdir(m.path) == []


def test_kill9_with_open_unlinked_file(make_pool: MakePool, mount_pool: MountPool) -> None:
    """An unlinked file still open when the daemon dies must not leak its space."""
    m = mount_pool(make_pool("16M"))
    (m.path / "keep").write_bytes(b"k" * 5000)
    fsync_path(m.path / "keep")
    fsync_path(m.path)
    sv0 = os.statvfs(m.path)
    fd = os.open(m.path / "orphan", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, stamp_data(3, 0, 1024, 1))  # 4 MiB
    os.fsync(fd)
    os.unlink(m.path / "orphan")
    fsync_path(m.path)
    os.pwrite(fd, stamp_block(3, 0, 2), 0)
    os.fsync(fd)
    assert os.statvfs(m.path).f_bfree <= sv0.f_bfree - 1024
    try:
        m.kill9()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    assert_check_clean(m.pool)
    m.start()
    assert os.listdir(m.path) == ["keep"]
    assert (m.path / "keep").read_bytes() == b"k" * 5000
    assert wait_until(lambda: os.statvfs(m.path).f_bfree >= sv0.f_bfree - 8), (
        f"space of the orphan not reclaimed: {os.statvfs(m.path).f_bfree} free, "
        f"{sv0.f_bfree} before"
    )


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
