"""A target that refuses a command's or a mount's token: the error names the token file that
was tried (given, recorded in the pool, or the user's local one) and how to name another
(issue 28). Real target daemons set up as docs/access.md shows, real commands, a real mount."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountPool
from helpers import cli, describe, status_json, wait_until, write_fsync

from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport.tokens import STATE_ENV, TOKEN_NAME, generated_token, new_token_file

HOW = "name the target's token file with --token-file F (a mount: -o token_file=F)"


@pytest.fixture
def target(work_dir: Path) -> Iterator[tuple[TargetProcess, Path]]:
    """`rpmemfs token new` and `rpmemfs target --token-file`, as docs/access.md shows."""
    token = work_dir / "token"
    res = cli("token", "new", token)
    assert res.returncode == 0, describe(res)
    (work_dir / "pools").mkdir()
    t = TargetProcess(work_dir / "pools", token_file=token, pmem="force", log_path=work_dir / "t.log")
    t.start()
    yield t, token
    t.close()


def _refused(res: subprocess.CompletedProcess[str], tried: str, status: int = 1) -> None:
    """Refused, saying which token file was tried: on stderr, or in verify's and sync's
    report of each replica."""
    out = res.stdout + res.stderr
    assert res.returncode == status and "Traceback" not in out, describe(res)
    assert len(res.stderr.splitlines()) <= 1, describe(res)
    assert "authentication failed" in out and tried in out and HOW in out, describe(res)


def test_every_command_a_target_refuses_names_the_token_file_it_tried(
    work_dir: Path, target: tuple[TargetProcess, Path], mount_pool: MountPool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t, token = target
    # This user's local token (what a command given none proves) is not the target's.
    state = Path(os.environ[STATE_ENV])
    generated_token(str(state))
    local = f"this user's local token, {state / TOKEN_NAME} (used when no token file is given)"
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", "--replica", f"{t.address}/app", "--token-file", token)
    assert res.returncode == 0, describe(res)

    # No --token-file: docs/failover.md shows it as optional.
    _refused(cli("pools", t.address), local, status=3)
    _refused(cli("evict", t.address, "app"), local)
    _refused(cli("promote", work_dir / "new.pool", "--from", f"{t.address}/app"), local)
    _refused(cli("recover", work_dir / "lost.pool", "--from", f"{t.address}/app"), local)
    _refused(cli("mkfs", work_dir / "b.pool", "--size", "64M", "--replica", f"{t.address}/b"), local)

    # A token file given that is not the target's.
    wrong = work_dir / "wrong.token"
    new_token_file(str(wrong))
    given = f"the token file given, {wrong}"
    for args in (("verify", pool), ("sync", pool), ("grow", pool, "--size", "128M"),
                 ("pools", t.address), ("promote", work_dir / "new.pool", "--from", f"{t.address}/app")):
        _refused(cli(*args, "--token-file", wrong), given, status=3 if args[0] == "pools" else 1)

    # The token file the pool records, no longer the target's (replaced since mkfs).
    os.replace(wrong, token)
    recorded = f"the token file recorded in the pool, {token}"
    for args in (("verify", pool), ("sync", pool), ("grow", pool, "--size", "128M")):
        _refused(cli(*args), recorded)

    # A mount's replica connections: its status and its log say the same.
    m = mount_pool(pool, options="pmem=force,min_replicas=0")
    write_fsync(m.path / "a", b"written alone")

    def last_error() -> str:
        return str(status_json(m.path)["replicas"][0].get("last_error") or "")

    assert wait_until(lambda: recorded in last_error()), (last_error(), m.output()[-3000:])
    assert HOW in last_error()
    assert re.search(f"authentication failed.*{re.escape(recorded)}", m.output()), m.output()[-3000:]

    # No local token at all: the command says where it looked.
    monkeypatch.setenv(STATE_ENV, str(work_dir / "nowhere"))
    res = cli("pools", t.address)
    assert res.returncode == 3 and len(res.stderr.splitlines()) == 1, describe(res)
    assert f"no local token ({work_dir / 'nowhere' / TOKEN_NAME} does not exist): {HOW}" in res.stderr, \
        describe(res)
