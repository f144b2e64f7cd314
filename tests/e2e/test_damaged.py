"""Damaged pools: truncation, broken headers, broken log records, broken checkpoints.

Each pool is built for real (mkfs, mount, operations with fsync, clean unmount); the byte
offsets to damage come from `rpmemfs check --json`'s layout. `check` must never modify the
pool, and nothing may print a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helpers import (
    Mount,
    assert_check_clean,
    assert_clean_error,
    check_json,
    cli,
    describe,
    diff_snapshots,
    fsync_path,
    snapshot,
)

if TYPE_CHECKING:
    from conftest import MakePool, MountPool


def pool_digest(pool: Path) -> str:
    return hashlib.sha256(pool.read_bytes()).hexdigest()


def flip_byte(pool: Path, offset: int) -> None:
    with open(pool, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"offset {offset} beyond the pool"
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def overwrite(pool: Path, offset: int, data: bytes) -> None:
    with open(pool, "r+b") as f:
        f.seek(offset)
        f.write(data)


def check_unmodified_fails(pool: Path, pattern: str | None = None) -> dict[str, Any]:
    """`check` (text and --json) reports problems, exits non-zero, and leaves the pool alone."""
    before = pool_digest(pool)
    res = cli("check", pool)
    assert res.returncode != 0, f"check passed a damaged pool\n{describe(res)}"
    assert "Traceback" not in res.stderr + res.stdout, describe(res)
    text = res.stdout + res.stderr
    assert text.strip(), f"check printed no report\n{describe(res)}"
    if pattern is not None:
        assert re.search(pattern, text, re.IGNORECASE), (
            f"check report does not match /{pattern}/\n{describe(res)}"
        )
    jres = cli("check", pool, "--json")
    assert pool_digest(pool) == before, "check modified the pool"
    try:
        report = json.loads(jres.stdout)
    except json.JSONDecodeError:
        # a pool that cannot be read at all: a plain error is fine for --json too
        assert_clean_error(jres, pattern)
        return {"clean": False, "problems": [jres.stderr]}
    assert jres.returncode != 0, describe(jres)
    assert "Traceback" not in jres.stderr, describe(jres)
    assert report.get("clean") is False, report
    assert report.get("problems"), report
    assert all(isinstance(p, str) and p for p in report["problems"]), report
    return report


def layout(pool: Path) -> dict[str, Any]:
    before = pool_digest(pool)
    rc, report = check_json(pool)
    assert rc == 0 and report["clean"] is True, report
    assert pool_digest(pool) == before, "check modified the pool"
    lay = report["layout"]
    for key in ("header", "header_backup", "log_areas", "data"):
        assert key in lay, f"layout lacks {key}: {lay}"
    return lay


def active_area(lay: dict[str, Any]) -> dict[str, Any]:
    active = [a for a in lay["log_areas"] if a["active"]]
    assert len(active) == 1, f"expected exactly one active log area: {lay['log_areas']}"
    return active[0]


def build_pool(make_pool: MakePool, mount_pool: MountPool, n_ops: int = 6) -> tuple[
    Mount, list[dict[str, Any]]
]:
    """A pool with a few fsynced operations (N_OPS file creations, then an append to file0),
    cleanly unmounted. Returns the Mount (stopped) and the tree snapshots after each
    operation (index 0 = empty filesystem, -1 = after the append)."""
    m = mount_pool(make_pool("16M"))
    snaps = [snapshot(m.path)]
    for i in range(n_ops):
        p = m.path / f"file{i}"
        fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, f"content of file {i}\n".encode() * (i + 1))
        os.fsync(fd)
        os.close(fd)
        fsync_path(m.path)
        snaps.append(snapshot(m.path))
    # The last operation changes one existing file and is fsynced: it is the last record.
    with open(m.path / "file0", "ab") as f:
        f.write(b"LAST APPEND\n")
        f.flush()
        os.fsync(f.fileno())
    snaps.append(snapshot(m.path))
    m.unmount()
    return m, snaps


def records_of(area: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    recs = area["records"]
    assert recs, f"active log area lists no records: {area}"
    for r in recs:
        for key in ("offset", "length", "seq", "checkpoint"):
            assert key in r, f"record lacks {key}: {r}"
    seqs = [r["seq"] for r in recs]
    assert seqs == sorted(seqs), f"records not in replay order: {seqs}"
    return [r for r in recs if r["checkpoint"]], [r for r in recs if not r["checkpoint"]]


def names_record(msg: str, rec: dict[str, Any]) -> bool:
    return bool(
        re.search(rf"\b{rec['seq']}\b", msg)
        or str(rec["offset"]) in msg
        or hex(rec["offset"]) in msg.lower()
    )


# ----------------------------------------------------------------------------- tests


def test_layout_is_sane(make_pool: MakePool, mount_pool: MountPool) -> None:
    m, _ = build_pool(make_pool, mount_pool, 3)
    lay = layout(m.pool)
    size = m.pool.stat().st_size
    h, hb, data = lay["header"], lay["header_backup"], lay["data"]
    assert h["length"] > 0 and hb["length"] > 0
    assert h["offset"] + h["length"] <= hb["offset"] or hb["offset"] + hb["length"] <= h["offset"]
    assert data["block_size"] == 4096
    assert data["offset"] + data["blocks"] * data["block_size"] <= size
    area = active_area(lay)
    ckpt, normal = records_of(area)
    assert ckpt, "no checkpoint records at the start of the active area"
    assert len(normal) >= 3, "fsynced operations left no log records"
    assert area["records"][: len(ckpt)] == ckpt, "checkpoint records must come first"
    for r in area["records"]:
        assert area["offset"] <= r["offset"] < area["offset"] + area["size"]


def test_truncated_pool(make_pool: MakePool, mount_pool: MountPool) -> None:
    m, _ = build_pool(make_pool, mount_pool, 2)
    size = m.pool.stat().st_size
    os.truncate(m.pool, size // 2)
    check_unmodified_fails(m.pool, r"truncat")
    out = m.start_expect_failure()
    assert re.search(r"truncat", out, re.IGNORECASE), out
    assert m.pool.stat().st_size == size // 2, "mount changed the size of a truncated pool"


def test_bad_primary_magic_uses_backup(make_pool: MakePool, mount_pool: MountPool) -> None:
    m, snaps = build_pool(make_pool, mount_pool)
    lay = layout(m.pool)
    overwrite(m.pool, lay["header"]["offset"], b"NOTMAGIC")
    check_unmodified_fails(m.pool, r"header")
    m.start()
    got = snapshot(m.path)
    assert got == snaps[-1], diff_snapshots(snaps[-1], got)
    (m.path / "after-repair").write_bytes(b"x")
    fsync_path(m.path / "after-repair")
    m.unmount()
    assert_check_clean(m.pool)
    with open(m.pool, "rb") as f:
        f.seek(lay["header"]["offset"])
        assert f.read(8) != b"NOTMAGIC", "primary header was not repaired"
    m.start()
    assert (m.path / "after-repair").read_bytes() == b"x"


def test_flipped_byte_in_primary_header(make_pool: MakePool, mount_pool: MountPool) -> None:
    m, snaps = build_pool(make_pool, mount_pool)
    lay = layout(m.pool)
    h = lay["header"]
    flip_byte(m.pool, h["offset"] + h["length"] // 2)
    check_unmodified_fails(m.pool, r"header")
    m.start()
    got = snapshot(m.path)
    assert got == snaps[-1], diff_snapshots(snaps[-1], got)
    m.unmount()
    assert_check_clean(m.pool)


def test_flipped_byte_in_backup_header_is_repaired(
    make_pool: MakePool, mount_pool: MountPool
) -> None:
    """A mount repairs a damaged backup header too: afterwards the primary can be lost."""
    m, snaps = build_pool(make_pool, mount_pool)
    lay = layout(m.pool)
    hb, h = lay["header_backup"], lay["header"]
    flip_byte(m.pool, hb["offset"] + hb["length"] // 2)
    m.start()
    assert snapshot(m.path) == snaps[-1]
    m.unmount()
    assert_check_clean(m.pool)
    overwrite(m.pool, h["offset"], b"NOTMAGIC")
    m.start()  # only possible with a good backup header
    got = snapshot(m.path)
    assert got == snaps[-1], diff_snapshots(snaps[-1], got)
    m.unmount()
    assert_check_clean(m.pool)


def test_check_reports_damaged_backup_header(make_pool: MakePool, mount_pool: MountPool) -> None:
    m, _ = build_pool(make_pool, mount_pool, 2)
    lay = layout(m.pool)
    hb = lay["header_backup"]
    flip_byte(m.pool, hb["offset"] + hb["length"] // 2)
    check_unmodified_fails(m.pool, r"header")


def test_both_headers_destroyed(make_pool: MakePool, mount_pool: MountPool) -> None:
    m, _ = build_pool(make_pool, mount_pool, 2)
    lay = layout(m.pool)
    for h in (lay["header"], lay["header_backup"]):
        overwrite(m.pool, h["offset"], b"\0" * h["length"])
    not_a_pool = r"not an? (valid )?rpmemfs pool|no valid (pool )?header"
    check_unmodified_fails(m.pool, not_a_pool)
    before = pool_digest(m.pool)
    out = m.start_expect_failure()
    assert re.search(not_a_pool, out, re.IGNORECASE), out
    assert pool_digest(m.pool) == before, "a refused mount modified the pool"


def test_not_a_pool_at_all(work_dir: Path, mount_pool: MountPool) -> None:
    junk = work_dir / "junk.img"
    junk.write_bytes(b"this is not a pool\n" * 500_000)
    not_a_pool = r"not an? (valid )?rpmemfs pool|no valid (pool )?header"
    check_unmodified_fails(junk, not_a_pool)
    m = mount_pool(junk, start=False)
    out = m.start_expect_failure()
    assert re.search(not_a_pool, out, re.IGNORECASE), out
    empty = work_dir / "empty.img"
    empty.touch()
    res = cli("check", empty)
    assert_clean_error(res)
    m2 = mount_pool(empty, start=False)
    m2.start_expect_failure()


def test_flipped_byte_in_middle_record_refused(
    make_pool: MakePool, mount_pool: MountPool
) -> None:
    m, _ = build_pool(make_pool, mount_pool)
    lay = layout(m.pool)
    _, normal = records_of(active_area(lay))
    assert len(normal) >= 2, f"need two log records after the checkpoint, have {normal}"
    victim = normal[len(normal) // 2 - 1] if len(normal) > 2 else normal[0]
    assert victim is not normal[-1]
    flip_byte(m.pool, victim["offset"] + victim["length"] // 2)
    report = check_unmodified_fails(m.pool, r"record|log")
    assert any(names_record(p, victim) for p in report["problems"]), (
        f"no problem names record seq {victim['seq']} at {victim['offset']}: {report['problems']}"
    )
    before = pool_digest(m.pool)
    out = m.start_expect_failure()
    assert re.search(r"record|log", out, re.IGNORECASE), out
    assert names_record(out, victim), f"mount error does not name the damaged record {victim}:\n{out}"
    assert pool_digest(m.pool) == before, "a refused mount modified the pool"


def test_flipped_byte_in_last_record_is_a_torn_write(
    make_pool: MakePool, mount_pool: MountPool
) -> None:
    m, snaps = build_pool(make_pool, mount_pool)
    lay = layout(m.pool)
    _, normal = records_of(active_area(lay))
    last = normal[-1]
    flip_byte(m.pool, last["offset"] + last["length"] // 2)
    # A torn last record is what any crash mid-append leaves: not a problem for check.
    before = pool_digest(m.pool)
    rc, report = check_json(m.pool)
    assert pool_digest(m.pool) == before, "check modified the pool"
    assert rc == 0 and report["clean"] is True, report
    listed = [r["seq"] for r in active_area(report["layout"])["records"]]
    assert last["seq"] not in listed, f"damaged record still listed as valid: {listed}"
    m.start()
    got = snapshot(m.path)
    # the last record's change (the fsynced append to file0) is gone: the tree is what it
    # was before the last operation
    assert got != snaps[-1], "the damaged last record was replayed"
    assert got == snaps[-2], diff_snapshots(snaps[-2], got)
    assert not (m.path / "file0").read_bytes().endswith(b"LAST APPEND\n")
    (m.path / "new-after-torn").write_bytes(b"ok")
    fsync_path(m.path / "new-after-torn")
    fsync_path(m.path)
    m.unmount()
    assert_check_clean(m.pool)
    m.start()
    assert (m.path / "new-after-torn").read_bytes() == b"ok"


def test_flipped_byte_in_checkpoint_record_refused(
    make_pool: MakePool, mount_pool: MountPool
) -> None:
    m, _ = build_pool(make_pool, mount_pool, 2)
    lay = layout(m.pool)
    ckpt, _ = records_of(active_area(lay))
    assert ckpt, "the active area has no checkpoint records"
    victim = ckpt[0]
    flip_byte(m.pool, victim["offset"] + victim["length"] // 2)
    check_unmodified_fails(m.pool, r"checkpoint")
    before = pool_digest(m.pool)
    out = m.start_expect_failure()
    assert re.search(r"checkpoint", out, re.IGNORECASE), out
    assert pool_digest(m.pool) == before, "a refused mount modified the pool"


def test_flipped_byte_in_fresh_pool_checkpoint(make_pool: MakePool, mount_pool: MountPool) -> None:
    """Right after mkfs the active area starts with checkpoint records."""
    pool = make_pool("8M")
    lay = layout(pool)
    ckpt, _ = records_of(active_area(lay))
    assert ckpt, "a fresh pool has no checkpoint record"
    victim = ckpt[-1]
    flip_byte(pool, victim["offset"] + victim["length"] // 2)
    check_unmodified_fails(pool, r"checkpoint")
    m = mount_pool(pool, start=False)
    out = m.start_expect_failure()
    assert re.search(r"checkpoint", out, re.IGNORECASE), out
