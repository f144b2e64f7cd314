"""Real programs on a real rpmemfs mount: tar, git, sqlite, shutil.copytree."""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, Mount, diff_snapshots, make_tree, snapshot


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    res = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, (
        f"$ {' '.join(argv)} (in {cwd})\nexit {res.returncode}\n{res.stdout}\n{res.stderr}"
    )
    return res.stdout


def test_tar_round_trip(mnt: Mount, work_dir: Path) -> None:
    src = work_dir / "src"
    make_tree(src, random.Random(42), nfiles=150, max_size=400_000)
    want = snapshot(src, meta=False)
    assert sum(e.kind == "file" for e in want.values()) == 150

    archive = mnt.path / "archive.tar"
    run(["tar", "-cf", str(archive), "-C", str(src), "."], cwd=work_dir)
    out = mnt.path / "extracted"
    out.mkdir()
    run(["tar", "-xf", str(archive), "-C", str(out)], cwd=work_dir)
    got = snapshot(out, meta=False)
    assert got == want, diff_snapshots(want, got)
    # tar's own verification: compare the archive against the extracted tree on the mount
    run(["tar", "--compare", "-f", str(archive), "-C", str(out)], cwd=work_dir)

    # and back out again: archive made from the mount, extracted off the mount
    archive2 = work_dir / "again.tar"
    run(["tar", "-cf", str(archive2), "-C", str(out), "."], cwd=work_dir)
    back = work_dir / "back"
    back.mkdir()
    run(["tar", "-xf", str(archive2), "-C", str(back)], cwd=work_dir)
    assert snapshot(back, meta=False) == want

    archive_sum = snapshot(mnt.path, meta=False)["archive.tar"]
    mnt.remount()
    got = snapshot(out, meta=False)
    assert got == want, diff_snapshots(want, got)
    assert snapshot(mnt.path, meta=False)["archive.tar"] == archive_sum
    run(["tar", "--compare", "-f", str(archive), "-C", str(out)], cwd=work_dir)


def git_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(home), GIT_CONFIG_NOSYSTEM="1", LC_ALL="C")
    return env


def test_git(mnt: Mount, work_dir: Path) -> None:
    home = work_dir / "home"
    home.mkdir()
    env = git_env(home)
    repo = mnt.path / "repo"
    run(["git", "init", "-q", "-b", "main", str(repo)], cwd=work_dir, env=env)
    run(["git", "config", "user.name", "Test User"], cwd=repo, env=env)
    run(["git", "config", "user.email", "test@example.invalid"], cwd=repo, env=env)
    rng = random.Random(7)
    commits = 0
    for round_ in range(6):
        if round_ >= 2:
            run(["git", "rm", "-q", f"bin{round_ - 2}.dat"], cwd=repo, env=env)
            run(["git", "mv", "pkg0", f"pkg0_r{round_}"], cwd=repo, env=env)
        for i in range(15):
            sub = repo / f"pkg{i % 3}"
            sub.mkdir(exist_ok=True)
            (sub / f"mod{i}.txt").write_text(
                "".join(f"line {j} of round {round_} {rng.random()}\n" for j in range(200))
            )
        (repo / f"bin{round_}.dat").write_bytes(rng.randbytes(50_000))
        run(["git", "add", "-A"], cwd=repo, env=env)
        run(["git", "commit", "-q", "-m", f"round {round_}"], cwd=repo, env=env)
        commits += 1
    run(["git", "fsck", "--full", "--strict"], cwd=repo, env=env)
    run(["git", "gc", "-q"], cwd=repo, env=env)
    run(["git", "fsck", "--full", "--strict"], cwd=repo, env=env)
    head = run(["git", "rev-parse", "HEAD"], cwd=repo, env=env).strip()
    tree = run(["git", "ls-tree", "-r", "HEAD"], cwd=repo, env=env)
    assert run(["git", "status", "--porcelain"], cwd=repo, env=env) == ""
    assert len(run(["git", "log", "--oneline"], cwd=repo, env=env).splitlines()) == commits

    mnt.remount()
    run(["git", "fsck", "--full", "--strict"], cwd=repo, env=env)
    assert run(["git", "rev-parse", "HEAD"], cwd=repo, env=env).strip() == head
    assert run(["git", "ls-tree", "-r", "HEAD"], cwd=repo, env=env) == tree
    assert run(["git", "status", "--porcelain"], cwd=repo, env=env) == ""
    # a fresh clone of the repo on the mount checks out the same tree
    run(["git", "clone", "-q", str(repo), str(mnt.path / "clone")], cwd=work_dir, env=env)
    clone_tree = run(["git", "ls-tree", "-r", "HEAD"], cwd=mnt.path / "clone", env=env)
    assert clone_tree == tree
    want = {k: v for k, v in snapshot(repo, meta=False).items() if not k.startswith(".git")}
    got = {k: v for k, v in snapshot(mnt.path / "clone", meta=False).items()
           if not k.startswith(".git")}
    assert got == want, diff_snapshots(want, got)


@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_sqlite(mnt: Mount, journal_mode: str) -> None:
    db = mnt.path / "db" / "test.sqlite"
    db.parent.mkdir()
    con = sqlite3.connect(db, isolation_level=None)
    try:
        mode = con.execute(f"PRAGMA journal_mode={journal_mode}").fetchone()[0]
        assert mode == journal_mode
        con.execute("PRAGMA synchronous=FULL")
        con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, k TEXT UNIQUE, v BLOB)")
        rng = random.Random(3)
        expected: dict[str, bytes] = {}
        for txn in range(150):
            con.execute("BEGIN")
            for j in range(rng.randrange(1, 8)):
                key = f"k{txn}-{j}"
                val = rng.randbytes(rng.randrange(10, 3000))
                con.execute("INSERT INTO t (k, v) VALUES (?, ?)", (key, val))
                expected[key] = val
            if expected and txn % 5 == 0:
                victim = rng.choice(sorted(expected))
                con.execute("DELETE FROM t WHERE k = ?", (victim,))
                del expected[victim]
            if txn % 10 == 0:
                key = rng.choice(sorted(expected))
                newval = b"updated" + rng.randbytes(500)
                con.execute("UPDATE t SET v = ? WHERE k = ?", (newval, key))
                expected[key] = newval
            con.execute("COMMIT")
        # a rolled-back transaction leaves no trace
        con.execute("BEGIN")
        con.execute("INSERT INTO t (k, v) VALUES ('rolled-back', x'00')")
        con.execute("DELETE FROM t")
        assert con.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0
        con.execute("ROLLBACK")
        assert con.execute("SELECT COUNT(*) FROM t").fetchone()[0] == len(expected)
        assert con.execute("SELECT 1 FROM t WHERE k = 'rolled-back'").fetchone() is None
        # a big transaction that spills the page cache
        con.execute("BEGIN")
        for i in range(400):
            v = rng.randbytes(4000)
            con.execute("INSERT INTO t (k, v) VALUES (?, ?)", (f"bulk{i}", v))
            expected[f"bulk{i}"] = v
        con.execute("COMMIT")
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        if journal_mode == "wal":
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.execute("VACUUM")
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()

    def verify() -> None:
        c = sqlite3.connect(db)
        try:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert c.execute("PRAGMA journal_mode").fetchone()[0] == journal_mode
            rows = dict(c.execute("SELECT k, v FROM t").fetchall())
        finally:
            c.close()
        assert len(rows) == len(expected)
        assert rows == expected

    verify()
    mnt.remount()
    verify()


def test_sqlite_cli(mnt: Mount, work_dir: Path) -> None:
    db = mnt.path / "cli.db"
    script = "".join(
        f"BEGIN; INSERT INTO t VALUES ({i}, '{'v' * (i % 50)}'); COMMIT;\n" for i in range(300)
    )
    run(["sqlite3", str(db), "CREATE TABLE t (a INTEGER PRIMARY KEY, b TEXT);"], cwd=work_dir)
    res = subprocess.run(
        ["sqlite3", str(db)], input=script, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert run(["sqlite3", str(db), "PRAGMA integrity_check;"], cwd=work_dir).strip() == "ok"
    mnt.remount()
    assert run(["sqlite3", str(db), "SELECT COUNT(*), SUM(a) FROM t;"],
               cwd=work_dir).strip() == f"300|{sum(range(300))}"


def test_copytree(mnt: Mount, work_dir: Path) -> None:
    # Snapshot the sources first (they may be edited while the tests run).
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    src = work_dir / "src"
    shutil.copytree(REPO / "rpmemfs", src / "rpmemfs", symlinks=True, ignore=ignore)
    shutil.copytree(REPO / "tests", src / "tests", symlinks=True, ignore=ignore)
    want = snapshot(src, meta=False)
    assert any(k.endswith(".py") for k in want)

    dst = mnt.path / "copy"
    shutil.copytree(src, dst, symlinks=True)
    got = snapshot(dst, meta=False)
    assert got == want, diff_snapshots(want, got)
    # copy2 preserved modes and nanosecond mtimes
    for rel, entry in snapshot(src).items():
        if entry.kind == "file":
            s, d = os.stat(src / rel), os.stat(dst / rel)
            assert (s.st_mode, s.st_mtime_ns) == (d.st_mode, d.st_mtime_ns), rel
    # a second copy on the mount, mount -> mount
    shutil.copytree(dst, mnt.path / "copy2", symlinks=True)
    assert snapshot(mnt.path / "copy2", meta=False) == want
    shutil.rmtree(mnt.path / "copy2")
    assert sorted(os.listdir(mnt.path)) == ["copy"]

    mnt.remount()
    got = snapshot(dst, meta=False)
    assert got == want, diff_snapshots(want, got)
