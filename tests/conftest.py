"""Fixtures for the FUSE-level tests: a scratch dir on /dev/shm, pools, real mounts."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import (  # noqa: E402
    Mount,
    cli,
    describe,
    fusermount_detach,
    mkfs,
    mounts_under,
)

MakePool = Callable[..., Path]
MountPool = Callable[..., Mount]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


def _passed(request: pytest.FixtureRequest) -> bool:
    rep = getattr(request.node, "rep_call", None)
    return rep is not None and rep.passed


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """A fresh directory under /dev/shm, removed (after detaching any mounts) afterwards."""
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-test-", dir="/dev/shm"))
    yield d
    for mp in mounts_under(d):
        fusermount_detach(Path(mp))
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_pool(work_dir: Path) -> MakePool:
    """make_pool(size="64M", name=None) -> path of a freshly made pool."""
    counter = 0

    def _make(size: str = "64M", name: str | None = None) -> Path:
        nonlocal counter
        counter += 1
        pool = work_dir / (name or f"pool{counter}.img")
        mkfs(pool, size)
        return pool

    return _make


@pytest.fixture
def mount_pool(work_dir: Path, request: pytest.FixtureRequest) -> Iterator[MountPool]:
    """mount_pool(pool, name=None, options="pmem=force", start=True) -> a running Mount.

    At teardown every mount is stopped. If the test passed, a daemon still running must
    unmount cleanly (exit 0, no traceback) and `rpmemfs check` must find the pool clean."""
    mounts: list[Mount] = []

    def _mount(
        pool: Path, name: str | None = None, options: str = "pmem=force", start: bool = True
    ) -> Mount:
        path = work_dir / (name or f"mnt{len(mounts) + 1}")
        m = Mount(pool, path, work_dir, options)
        mounts.append(m)
        if start:
            m.start()
        return m

    yield _mount

    problems: list[str] = []
    strict = _passed(request)
    for m in mounts:
        if strict and m.running:
            try:
                m.unmount()
            except AssertionError as exc:
                problems.append(f"teardown unmount of {m.path}: {exc}")
            else:
                res = cli("check", m.pool)
                if res.returncode != 0:
                    problems.append(f"pool not clean after the test:\n{describe(res)}")
        m.cleanup()
    if problems:
        pytest.fail("\n\n".join(problems))


@pytest.fixture
def mnt(make_pool: MakePool, mount_pool: MountPool) -> Mount:
    """A fresh 64M pool, mounted (pmem=force). Use mnt.path, mnt.remount(), mnt.kill9()."""
    return mount_pool(make_pool("64M"))
