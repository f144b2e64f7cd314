"""Nobody but a pool's owner reaches it: tokens, per-pool authorization, pool files and the
control plane, tried as a hostile local user would (issue 15).

"As another user" runs in a child forked from this process that drops to user nobody: the
interpreter lives under /root, which nobody may not read, so it cannot be started anew.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import CLI, REPO, cli, describe, status_json, wait_until, write_fsync

from rpmemfs.mountd import control
from rpmemfs.target import admin
from rpmemfs.tools.processes import SpawnError, TargetProcess, child_env, detach_all_under
from rpmemfs.transport import TransportError, barrier, connect
from rpmemfs.transport.tokens import STATE_ENV, TOKEN_NAME, local_token, new_token_file

pytestmark = pytest.mark.timeout(120)

POOL = 1 << 20
NOBODY = 65534


def run_as_nobody(fn: Callable[[], Any]) -> Any:
    """``fn()`` run by user nobody (a forked child): what it returned, or the text of what it
    raised, as ``("raised", text)``."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to become another user")
    # A file, not a pipe: a daemon the child forks (a mount) holds every descriptor it had,
    # and the end of a pipe would come only when that daemon has gone.
    with tempfile.TemporaryFile() as answer:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                try:
                    out: Any = fn()
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    out = ("raised", f"{type(exc).__name__}: {exc}")
                os.write(answer.fileno(), json.dumps(out).encode())
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        answer.seek(0)
        result = json.loads(answer.read())
    return tuple(result) if isinstance(result, list) else result


@pytest.fixture
def scratch() -> Iterator[Path]:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="rpmemfs-guard-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _target(pool_dir: Path, **kw: Any) -> TargetProcess:
    pool_dir.mkdir(exist_ok=True)
    t = TargetProcess(pool_dir, **kw)
    t.start()
    return t


def _start_fails(pool_dir: Path, **kw: Any) -> str:
    t = TargetProcess(pool_dir, **kw)
    try:
        with pytest.raises(SpawnError) as err:
            t.start()
    finally:
        t.close()
    return str(err.value)


def _token(path: Path) -> bytes:
    new_token_file(str(path))
    return path.read_bytes().strip()


# --------------------------------------------------------------------------- no unauthenticated mode


def test_another_local_user_gets_nothing_from_a_target_started_without_a_token(scratch: Path) -> None:
    """The target generated its token where only its user may read it; a local user who
    cannot read it can neither list, read, write nor remove a pool, and cannot read the
    token or the replica file either."""
    scratch.chmod(0o711)  # what keeps nobody out is the files' own modes
    t = _target(scratch / "pools")
    try:
        secret = os.urandom(4096)

        async def fill() -> None:
            async with await connect(t.address, None, lanes=1) as s:
                region = await s.create_pool("root-only", POOL)
                await barrier(s.lanes[0], region, [(0, secret)])

        trio.run(fill)
        token_path = Path(os.environ[STATE_ENV]) / TOKEN_NAME
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
        assert "initiators must hold the token in " + str(token_path) in t.log_text()

        def attempt(token: bytes | None) -> Callable[[], Any]:
            def go() -> Any:
                async def main() -> Any:
                    async with await connect(t.address, token, lanes=1, timeout=5) as s:
                        return [await s.control({"op": "pools"}),
                                await s.control({"op": "remove", "name": "root-only"})]
                return trio.run(main)
            return go

        for token in (None, b"", b"0" * 64, token_path.name.encode() * 8):
            got = run_as_nobody(attempt(token))
            assert isinstance(got, tuple) and got[0] == "raised" and "TransportError" in got[1], got
            assert "no token" in got[1] or "not one this target accepts" in got[1], got
        for path in (token_path, t.pool_dir / "root-only"):
            got = run_as_nobody(lambda p=path: Path(p).read_bytes().hex())
            assert got[0] == "raised" and "PermissionError" in got[1], got
        # The pool is intact and still the owner's.
        assert (t.pool_dir / "root-only").read_bytes()[: len(secret)] == secret
    finally:
        t.close()


@pytest.mark.parametrize("content, mode, why", [
    (b"0123456789abcdef" * 4, 0o644, "group or others may read or change it"),
    (b"0123456789abcdef" * 4, 0o640, "group or others may read or change it"),
    (b"0123456789abcdef", 0o600, "at most 64 bits; at least 128 are needed"),
    (b"short secret", 0o600, "at least 128 are needed"),
    (b"", 0o600, "is empty"),
])
def test_a_weak_token_file_is_refused_at_start(scratch: Path, content: bytes, mode: int, why: str) -> None:
    token = scratch / "token"
    token.write_bytes(content + b"\n")
    token.chmod(mode)
    (scratch / "pools").mkdir()
    assert why in _start_fails(scratch / "pools", token_file=token)
    # ... and by the commands that read it, as by a mount.
    res = cli("pools", "127.0.0.1:1", "--token-file", token)
    assert res.returncode == 3 and why in res.stderr, describe(res)  # 3: no answer


def test_token_new_makes_a_private_256_bit_token_the_target_accepts(scratch: Path) -> None:
    path = scratch / "made"
    res = cli("token", "new", path)
    assert res.returncode == 0, describe(res)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes().strip()) == 64
    again = cli("token", "new", path)
    assert again.returncode == 1 and "exists" in again.stderr
    t = _target(scratch / "pools", token_file=path)
    try:
        res = cli("pools", t.address, "--token-file", path)
        assert res.returncode == 0 and "0 pools" in res.stdout, describe(res)
        res = cli("pools", t.address)  # the test run's generated token (if any) is not this target's
        assert res.returncode == 3, describe(res)
        assert "not one this target accepts" in res.stderr or "no token" in res.stderr, describe(res)
    finally:
        t.close()


def test_a_state_directory_of_another_user_or_open_to_others_is_refused(scratch: Path) -> None:
    (scratch / "pools").mkdir()
    state = scratch / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    why = _start_fails(scratch / "pools", extra=["--state-dir", str(state)])
    assert f"belongs to uid {NOBODY}" in why
    os.chown(state, 0, 0)
    state.chmod(0o777)
    why = _start_fails(scratch / "pools", extra=["--state-dir", str(state)])
    assert "others may change what is in it" in why


# --------------------------------------------------------------------------- per-pool authorization


@pytest.fixture
def authz_target(scratch: Path) -> Iterator[tuple[TargetProcess, bytes, bytes]]:
    """A target with its admin token and alice's, limited to pools alice-* and shared."""
    admin_token, alice = _token(scratch / "admin.token"), _token(scratch / "alice.token")
    rules = scratch / "authz"
    rules.write_text(f"# name role token pools\nalice pools {scratch / 'alice.token'} alice-* shared\n")
    t = _target(scratch / "pools", token_file=scratch / "admin.token", extra=["--authz", str(rules)])
    yield t, admin_token, alice
    t.close()


def test_a_token_limited_to_some_pools_reaches_only_those(
        authz_target: tuple[TargetProcess, bytes, bytes]) -> None:
    t, admin_token, alice = authz_target

    async def main() -> None:
        async with await connect(t.address, admin_token, lanes=0) as s:
            await s.create_pool("bob-db", POOL)
            await s.create_pool("shared", POOL)
        async with await connect(t.address, alice, lanes=1) as s:
            region = await s.create_pool("alice-1", POOL)
            await barrier(s.lanes[0], region, [(0, b"mine")])
            shared = await s.open_pool("shared")
            await s.close_pool(shared)
            for request in ({"op": "create", "name": "bob-2", "size": POOL}, {"op": "open", "name": "bob-db"},
                            {"op": "probe", "name": "bob-db"}, {"op": "remove", "name": "bob-db"},
                            {"op": "stats", "name": "bob-db"}):
                with pytest.raises(TransportError, match="token 'alice' may not use pool 'bob-"):
                    await s.control(request)
            listed = await s.control({"op": "pools"})
            assert sorted(listed["pools"]) == ["alice-1", "shared"]
            assert sorted((await s.control({"op": "stats"}))["pools"]) == ["alice-1", "shared"]
        async with await connect(t.address, admin_token, lanes=0) as s:
            assert sorted((await s.control({"op": "pools"}))["pools"]) == ["alice-1", "bob-db", "shared"]

    trio.run(main)
    assert (t.pool_dir / "bob-db").exists() and not (t.pool_dir / "bob-2").exists()
    assert "token 'alice' may not use pool" in t.log_text()


def test_evict_needs_an_admin_token(scratch: Path, authz_target: tuple[TargetProcess, bytes, bytes]) -> None:
    """Issue 14 let any authenticated session evict; a pools token may not, even its own pool."""
    t, admin_token, alice = authz_target

    async def main() -> None:
        async with await connect(t.address, alice, lanes=0) as writer:
            await writer.create_pool("alice-w", POOL)
            await writer.open_pool("alice-w", (1 << 32, 1 << 32))  # claims it: the writing session
            with pytest.raises(TransportError, match="evict needs an admin token"):
                await admin.ask(t.address, alice, {"op": "evict", "name": "alice-w"}, 10)
            assert (await writer.probe_pool("alice-w"))["writer"] is not None
            reply = await admin.ask(t.address, admin_token, {"op": "evict", "name": "alice-w"}, 10)
            assert reply["evicted"]

    trio.run(main)
    res = cli("evict", t.address, "alice-w", "--token-file", scratch / "alice.token")
    assert res.returncode == 1 and "needs an admin token" in res.stderr, describe(res)


@pytest.mark.parametrize("line, why", [
    ("alice pools {tok}", "needs at least one pool name pattern"),
    ("alice root {tok} x", "role 'root' is not one of admin, pools"),
    ("alice admin {tok} x*", "give it no patterns"),
    ("alice pools", "expected NAME ROLE TOKEN-FILE"),
    ("same pools {admin} x", "is the same token as 'default'"),
])
def test_a_wrong_authorization_file_is_refused_at_start(scratch: Path, line: str, why: str) -> None:
    _token(scratch / "admin.token")
    _token(scratch / "alice.token")
    rules = scratch / "authz"
    line = line.format(tok=scratch / "alice.token", admin=scratch / "admin.token")
    rules.write_text(f"# ok\n{line}\n")
    (scratch / "pools").mkdir()
    out = _start_fails(scratch / "pools", token_file=scratch / "admin.token", extra=["--authz", str(rules)])
    assert f"{rules}:2" in out and why in out, out


def test_an_authz_file_others_may_change_is_refused_at_start_and_on_reload(scratch: Path) -> None:
    """Issue 30, item 5: with the authz file at mode 0666, a local user made alice an admin on
    the next SIGHUP; an emptied file was taken on reload, locking every tenant out. Now such a
    file is refused at start, and a reload of it changes nothing but a logged error."""
    scratch.chmod(0o711)  # nobody may reach the file; its own mode decides the rest
    admin_token, alice = _token(scratch / "admin.token"), _token(scratch / "alice.token")
    rules = scratch / "authz"
    rules.write_text(f"alice pools {scratch / 'alice.token'} alice-*\n")
    rules.chmod(0o666)
    (scratch / "pools").mkdir()
    why = _start_fails(scratch / "pools", token_file=scratch / "admin.token", extra=["--authz", str(rules)])
    assert f"authorization file {rules} has mode 0666: group or others may change it" in why, why
    rules.chmod(0o644)  # others may read it: it names token files, it holds none
    t = _target(scratch / "pools", token_file=scratch / "admin.token", extra=["--authz", str(rules)])

    async def alice_is_a_tenant() -> None:
        async with await connect(t.address, alice, lanes=0) as s:
            await s.close_pool(await s.create_pool(f"alice-{uuid.uuid4().hex[:8]}", POOL))
            with pytest.raises(TransportError, match="token 'alice' may not use pool 'bob-db'"):
                await s.control({"op": "remove", "name": "bob-db"})
            with pytest.raises(TransportError, match="evict needs an admin token"):
                await s.control({"op": "evict", "name": "bob-db"})

    def reload(times: int) -> str:
        assert t.proc is not None
        t.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: t.log_text().count("tokens not reread") == times), t.log_text()
        return t.log_text().rsplit("tokens not reread", 1)[1].splitlines()[0]

    try:
        async def bob() -> None:
            async with await connect(t.address, admin_token, lanes=0) as s:
                await s.close_pool(await s.create_pool("bob-db", POOL))

        trio.run(bob)
        trio.run(alice_is_a_tenant)
        # Loosened by mistake while the target runs; a local user makes alice an admin.
        rules.chmod(0o666)
        got = run_as_nobody(lambda: Path(rules).write_text(f"alice admin {scratch / 'alice.token'}\n"))
        assert isinstance(got, int), got
        line = reload(1)
        assert f"authorization file {rules} has mode 0666: group or others may change it" in line, line
        trio.run(alice_is_a_tenant)
        # An emptied file (a config tool's truncated write, say) would take every tenant's access.
        rules.write_text("# nothing yet\n")
        rules.chmod(0o644)
        assert "grants nothing" in reload(2)
        trio.run(alice_is_a_tenant)
        assert (t.pool_dir / "bob-db").exists()
    finally:
        t.close()


MIB = 1 << 20


@pytest.fixture
def small_pool_dir(scratch: Path) -> Iterator[Path]:
    """A pool directory on a file system of its own, 16 MiB: one tenant could fill it."""
    d = scratch / "pools"
    d.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M,mode=0700", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_tenant_cannot_fill_the_target_past_its_quota(scratch: Path, small_pool_dir: Path) -> None:
    """Issue 30, item 8: alice filled a target and the admin's next create failed with
    no-space. With `quota=8M pools=3` on her authz line, what would take her pools past it is
    refused with code quota, and the rest stays the admin's (and other tenants')."""
    admin_token, alice = _token(scratch / "admin.token"), _token(scratch / "alice.token")
    rules = scratch / "authz"
    rules.write_text(f"alice pools {scratch / 'alice.token'} alice-* shared quota=8M pools=3\n")
    t = _target(small_pool_dir, token_file=scratch / "admin.token", extra=["--authz", str(rules)])
    try:
        async def main() -> None:
            async with await connect(t.address, alice, lanes=0) as s:
                with pytest.raises(TransportError, match=r"token 'alice' may hold 8\.0 MiB on this target "
                                   r"and its pools hold 0 B: pool 'alice-big' at 12\.0 MiB would take "
                                   r"them to 12\.0 MiB \(its quota"):
                    await s.control({"op": "create", "name": "alice-big", "size": 12 * MIB})
                for name in ("alice-1", "alice-2"):
                    await s.close_pool(await s.create_pool(name, 4 * MIB))
                with pytest.raises(TransportError, match=r"its pools hold 8\.0 MiB: pool 'shared' at "
                                   r"4\.0 KiB would take them to 8\.0 MiB"):
                    await s.control({"op": "create", "name": "shared", "size": 4096})
                with pytest.raises(TransportError, match=r"pool 'alice-1' at 6\.0 MiB would take them "
                                   r"to 10\.0 MiB"):
                    await s.control({"op": "grow", "name": "alice-1", "size": 6 * MIB})
                await s.control({"op": "remove", "name": "alice-2"})
                await s.close_pool(await s.create_pool("alice-2", 2 * MIB))
                await s.close_pool(await s.create_pool("shared", 2 * MIB))
                with pytest.raises(TransportError, match="may have at most 3 pools on this target and has 3"):
                    await s.control({"op": "create", "name": "alice-3", "size": 4096})
            # What she could not take is still there for the admin.
            async with await connect(t.address, admin_token, lanes=0) as s:
                await s.close_pool(await s.create_pool("bob-db", 7 * MIB))

        trio.run(main)
        assert not (small_pool_dir / "alice-big").exists() and not (small_pool_dir / "alice-3").exists()
        assert (small_pool_dir / "alice-1").stat().st_size == 4 * MIB
        wanted = "quota of token alice: 8.0 MiB of 8.0 MiB, 3 of 3 pools"
        for token in ("alice.token", "admin.token"):
            res = cli("pools", t.address, "--token-file", scratch / token)
            assert res.returncode == 0 and res.stdout.rstrip().endswith(wanted), describe(res)
        assert "quota" in t.log_text()
    finally:
        t.close()


# --------------------------------------------------------------------------- pool files


@pytest.mark.parametrize("mode, owner, why", [
    (0o777, 0, "group or others may add, remove or swap pool files"),
    (0o775, 0, "group or others may add, remove or swap pool files"),
    (0o700, NOBODY, f"belongs to uid {NOBODY}"),
])
def test_a_pool_directory_others_may_change_is_refused(
        scratch: Path, mode: int, owner: int, why: str) -> None:
    d = scratch / "pools"
    d.mkdir()
    d.chmod(mode)
    os.chown(d, owner, owner)
    assert why in _start_fails(d)


def test_a_symlink_swapped_in_during_open_never_lets_the_target_write_outside(scratch: Path) -> None:
    """A pool file is replaced by a symbolic link to a file outside the pool directory (and
    back) as fast as possible while an initiator opens, writes, flushes and claims it: the
    outside files are never written, nor owner records planted as links followed."""
    t = _target(scratch / "pools")
    outside = scratch / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"\0" * POOL)
    owner_victim = outside / "owner-victim"
    owner_victim.write_bytes(b"keep")
    pools = t.pool_dir
    stop = threading.Event()
    swaps = 0

    def swapper() -> None:
        nonlocal swaps
        while not stop.is_set():
            for name, to in ((".link", victim), (".keep", None)):
                tmp = pools / f"{name}.tmp"
                if to is None:
                    os.link(pools / ".keep", tmp)
                else:
                    os.symlink(to, tmp)
                os.rename(tmp, pools / "swap")
                for record in (".swap.owner", ".swap.owner.tmp"):
                    if not os.path.lexists(pools / record):
                        os.symlink(owner_victim, pools / f"{record}.l")
                        os.rename(pools / f"{record}.l", pools / record)
            swaps += 1

    async def main() -> int:
        written = 0
        async with await connect(t.address, None, lanes=1) as s:
            # Closed, so that every open below opens and maps the file anew.
            await s.close_pool(await s.create_pool("swap", POOL))
            os.link(pools / "swap", pools / ".keep")
            thread = threading.Thread(target=swapper, daemon=True)
            thread.start()
            try:
                deadline = time.monotonic() + 6
                epoch = 1 << 32
                while time.monotonic() < deadline:
                    epoch += 1
                    try:
                        region = await s.open_pool("swap", (epoch - 1, epoch), takeover=True)
                    except TransportError as exc:
                        # (a planted record link met between unlink and create; the last
                        # mapping's lock not yet gone)
                        assert any(w in exc.reason for w in ("symbolic link", "File exists", "in use")), exc
                        continue
                    await barrier(s.lanes[0], region, [(0, b"EVIL" * 1024)])
                    await s.close_pool(region)
                    written += 1
            finally:
                stop.set()
                thread.join()
        return written

    try:
        written = trio.run(main)
    finally:
        t.close()
    assert written > 0 and swaps > 0
    assert victim.read_bytes() == b"\0" * POOL
    assert owner_victim.read_bytes() == b"keep"
    assert (pools / ".keep").read_bytes()[:4] == b"EVIL"  # the real pool got the writes


# --------------------------------------------------------------------------- control plane


TMP_SOCKETS = Path(f"/tmp/rpmemfs-{NOBODY}")  # nobody's socket directory when it has no runtime one
RUN_USER = Path(f"/run/user/{NOBODY}")


@pytest.fixture
def tmp_sockets() -> Iterator[Path]:
    """/tmp/rpmemfs-NOBODY, absent at the start (the test may plant it) and removed after."""
    if os.path.lexists(TMP_SOCKETS):
        pytest.skip(f"{TMP_SOCKETS} exists already: this test must make it itself")
    yield TMP_SOCKETS
    shutil.rmtree(TMP_SOCKETS, ignore_errors=True)


@pytest.fixture
def run_user() -> Iterator[Path]:
    """/run/user/NOBODY as logind makes it for a session, absent until the test makes it."""
    if os.path.lexists(RUN_USER):
        pytest.skip(f"{RUN_USER} exists already: this test must make it itself")
    if not RUN_USER.parent.is_dir():
        pytest.skip(f"no {RUN_USER.parent} on this host")
    yield RUN_USER
    shutil.rmtree(RUN_USER, ignore_errors=True)


def _make_run_user() -> None:
    RUN_USER.mkdir(mode=0o700)
    os.chown(RUN_USER, NOBODY, NOBODY)


def _plant(path: Path) -> None:
    """``path`` made first by root, open to all, as another user could make it."""
    path.mkdir(mode=0o777)
    path.chmod(0o777)


def test_a_control_socket_directory_another_user_made_first_is_refused(
        scratch: Path, tmp_sockets: Path) -> None:
    """With no runtime directory of its own, a user's socket directory is /tmp/rpmemfs-UID,
    where another user may have made it first: neither a client nor a mount uses it then. An
    XDG_RUNTIME_DIR that is not the user's (left by su, or shared) is not used either."""
    scratch.chmod(0o711)
    shared = scratch / "runtime"
    shared.mkdir()
    shared.chmod(0o1777)
    _plant(tmp_sockets)

    def ask() -> Any:
        os.environ["XDG_RUNTIME_DIR"] = str(shared)
        return control.query(str(scratch))

    got = run_as_nobody(ask)
    assert got[0] == "raised" and "ControlDirError" in got[1], got
    assert f"{tmp_sockets} belongs to uid 0 (root)" in got[1], got

    def serve() -> Any:
        os.environ["XDG_RUNTIME_DIR"] = str(shared)
        return trio.run(control.serve, control.socket_path(str(scratch)), {})

    got = run_as_nobody(serve)
    assert got[0] == "raised" and "someone else made it first" in got[1], got
    assert not os.path.lexists(shared / "rpmemfs") and not os.path.lexists(shared / f"rpmemfs-{NOBODY}")
    # Root's own directory open to others is refused as well.
    mine = scratch / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    with pytest.raises(control.ControlDirError, match="mode 0755"):
        control.check_socket_dir(str(mine))


def _import_everything() -> None:
    """Import what a mount and the commands use, while this process may still read the
    interpreter's library (user nobody may not: it is under /root)."""
    import importlib
    import pkgutil

    import rpmemfs

    for m in pkgutil.walk_packages(rpmemfs.__path__, "rpmemfs."):
        if m.name.startswith("rpmemfs.tools") or m.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(m.name)
        except ImportError:
            pass  # (RDMA's modules, without pyverbs)


def rpmemfs_as_nobody(*argv: str | Path, runtime: str | Path | None) -> tuple[int, str]:
    """`rpmemfs ARGV` run by user nobody with XDG_RUNTIME_DIR=``runtime`` (unset for None):
    its exit status and what it wrote on stderr."""
    import contextlib
    import io

    from rpmemfs.cli import main

    _import_everything()

    def run() -> Any:
        os.environ.pop("XDG_RUNTIME_DIR", None)
        if runtime is not None:
            os.environ["XDG_RUNTIME_DIR"] = str(runtime)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main([os.fspath(a) for a in argv])
        return [code, err.getvalue()]

    got = run_as_nobody(run)
    assert got[0] != "raised", got
    return int(got[0]), str(got[1])


@pytest.fixture
def nobodys_pool(scratch: Path) -> Iterator[tuple[Path, Path]]:
    """(a pool of user nobody's, a mount point of nobody's); mounts left are detached."""
    scratch.chmod(0o711)
    pool, mnt = scratch / "p.pool", scratch / "mnt"
    assert cli("mkfs", pool, "--size", "8M").returncode == 0
    mnt.mkdir()
    for path in (pool, mnt):
        os.chown(path, NOBODY, NOBODY)
    yield pool, mnt
    detach_all_under(scratch)


def _socket_in(directory: Path) -> bool:
    return directory.is_dir() and any(p.suffix == ".sock" for p in directory.iterdir())


def test_a_users_mount_takes_its_runtime_directory_when_tmp_is_taken(
        scratch: Path, nobodys_pool: tuple[Path, Path], tmp_sockets: Path, run_user: Path) -> None:
    """Another user made /tmp/rpmemfs-UID first: with neither XDG_RUNTIME_DIR nor /run/user/UID
    the mount is refused in one line that names who and what to do; with either of them it
    mounts there, and status and umount find it."""
    pool, mnt = nobodys_pool
    _plant(tmp_sockets)
    shared = scratch / "shared"  # an XDG_RUNTIME_DIR that is not nobody's: passed over
    shared.mkdir()
    shared.chmod(0o1777)
    for runtime in (None, shared):
        code, err = rpmemfs_as_nobody("mount", pool, mnt, runtime=runtime)
        assert code == 1, err
        assert err.count("\n") == 1 and err.startswith("rpmemfs: "), err
        assert f"{tmp_sockets} belongs to uid 0 (root), not to this user (uid {NOBODY})" in err, err
        assert "set XDG_RUNTIME_DIR to a directory of yours with mode 0700" in err, err
    assert not os.path.ismount(mnt) and os.listdir(shared) == []

    runtime = scratch / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, NOBODY, NOBODY)
    _make_run_user()
    for env, where in ((runtime, runtime / "rpmemfs"), (None, run_user / "rpmemfs"),
                       (shared, run_user / "rpmemfs")):
        code, err = rpmemfs_as_nobody("mount", pool, mnt, runtime=env)
        assert code == 0, err
        # (the daemon binds its socket just after it says it is mounted)
        assert wait_until(lambda where=where: _socket_in(where)), list(where.parent.iterdir())
        code, err = rpmemfs_as_nobody("status", mnt, runtime=env)
        assert code == 0, err
        code, err = rpmemfs_as_nobody("umount", mnt, runtime=env)
        assert code == 0, err
        assert not os.path.ismount(mnt) and not _socket_in(where)
    assert os.listdir(tmp_sockets) == []


def test_status_finds_a_mount_started_before_the_users_runtime_directory_was_there(
        nobodys_pool: tuple[Path, Path], tmp_sockets: Path, run_user: Path) -> None:
    """Mounted at boot or from cron (no session: /tmp/rpmemfs-UID), asked from a session
    later (/run/user/UID now there, and preferred for new mounts): status and umount find it."""
    pool, mnt = nobodys_pool
    code, err = rpmemfs_as_nobody("mount", pool, mnt, runtime=None)
    assert code == 0, err
    assert wait_until(lambda: _socket_in(tmp_sockets))
    _make_run_user()
    code, err = rpmemfs_as_nobody("status", mnt, runtime=run_user)
    assert code == 0, err
    code, err = rpmemfs_as_nobody("umount", mnt, runtime=run_user)
    assert code == 0, err
    assert not os.path.ismount(mnt) and not _socket_in(tmp_sockets)


def test_verify_clients_killed_at_random_moments_leave_the_mount_serving(
        work_dir: Path, targets: list[TargetProcess], mount_pool: Callable[..., Any]) -> None:
    pool = work_dir / "app.pool"
    replicas = [a for t in targets for a in ("--replica", f"{t.address}/app")]
    res = cli("mkfs", pool, "--size", "128M", *replicas)
    assert res.returncode == 0, describe(res)
    m = mount_pool(pool)
    write_fsync(m.path / "data", os.urandom(4 << 20))
    rng = random.Random(15)
    for _ in range(12):
        client = subprocess.Popen([*CLI, "verify", str(m.path), "--chunk", "4K"], cwd=REPO,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=child_env())
        time.sleep(rng.uniform(0.0, 0.6))
        client.send_signal(signal.SIGKILL)
        client.wait()
        assert m.running, f"the daemon died with a killed verify client\n{m.output()}"
    data = os.urandom(100_000)
    write_fsync(m.path / "after", data)
    assert (m.path / "after").read_bytes() == data
    res = cli("verify", m.path)
    assert res.returncode == 0 and "clean" in res.stdout, describe(res)
    assert [r["state"] for r in status_json(m.path)["replicas"]] == ["in-sync", "in-sync"]


def test_local_token_is_read_only_from_a_private_state_directory(scratch: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    state = scratch / "state"
    state.mkdir(mode=0o700)
    _token(state / TOKEN_NAME)
    monkeypatch.setenv(STATE_ENV, str(state))
    assert local_token() == (state / TOKEN_NAME).read_bytes().strip()
    state.chmod(0o777)
    with pytest.raises(TransportError, match="others may change what is in it"):
        local_token()
    state.chmod(0o700)
    (state / TOKEN_NAME).chmod(0o644)
    with pytest.raises(TransportError, match="chmod 600"):
        local_token()
    monkeypatch.setenv(STATE_ENV, str(scratch / f"none-{uuid.uuid4().hex}"))
    assert local_token() is None
