"""A device that is not device DAX is no pool: every command that takes a pool says so in one
line, and leaves the device node alone (mkfs --force once unlinked it). The nodes are made
here, private to the test, so that a mistake costs nothing outside it: a character device
numbered as /dev/null (1:3, sysfs class 'mem') and a block device. (Pools on a real device DAX
are tested in the VM: tests/verbs/test_devdax.py.)"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from helpers import Mount, assert_clean_error, cli, mkfs_replicated

from rpmemfs.tools.processes import TargetProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


def probe_epoch(t: TargetProcess) -> object:
    res = cli("pools", t.address, "--json")
    assert res.returncode == 0, res
    return (json.loads(res.stdout)["app"]["owner"] or {}).get("epoch")


@pytest.fixture
def null(tmp_path: Path) -> Path:
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return node


@pytest.mark.parametrize("args", [
    ("mkfs",),
    ("mkfs", "--size", "64M"),
    ("mkfs", "--size", "64M", "--force"),
    ("check",),
    ("grow", "--size", "128M"),
    ("verify",),
])
def test_commands_refuse_a_device_that_is_not_device_dax(null: Path, args: tuple[str, ...]) -> None:
    res = cli(args[0], null, *args[1:])
    assert res.returncode == 1, res
    assert_clean_error(res, rf"{null} is a character device but not device DAX .*'mem'", one_line=True)
    assert stat.S_ISCHR(os.lstat(null).st_mode)


def test_mkfs_force_leaves_a_block_device_alone(tmp_path: Path) -> None:
    node = tmp_path / "blk"
    os.mknod(node, stat.S_IFBLK | 0o600, os.makedev(7, 250))
    res = cli("mkfs", node, "--size", "64M", "--force")
    assert res.returncode == 1, res
    assert_clean_error(res, "is not a regular file: a pool is a file or a device DAX", one_line=True)
    assert stat.S_ISBLK(os.lstat(node).st_mode)


def test_mount_refuses_a_device_that_is_not_device_dax(null: Path, tmp_path: Path) -> None:
    out = Mount(null, tmp_path / "mnt", tmp_path, options="pmem=auto").start_expect_failure()
    assert f"{null} is a character device but not device DAX" in out, out
    assert stat.S_ISCHR(os.lstat(null).st_mode)


@pytest.mark.parametrize(("given", "why"), [
    ("app={null}", r"--pool-dev app={null}: {null} is a character device but not device DAX"),
    ("app", r"--pool-dev 'app': give NAME=/dev/daxX\.Y"),
    ("a/b={null}", r"--pool-dev 'a/b=.*': pool name 'a/b' contains '/'"),
])
def test_a_target_refuses_a_pool_dev_that_is_not_device_dax(null: Path, tmp_path: Path, given: str,
                                                             why: str) -> None:
    d = tmp_path / "pools"
    d.mkdir(mode=0o700)
    token = tmp_path / "token"
    assert cli("token", "new", token).returncode == 0
    res = cli("target", "--listen", "127.0.0.1:0", "--pool-dir", d, "--token-file", token,
              "--pool-dev", given.format(null=null))
    assert res.returncode == 2, res
    assert_clean_error(res, why.format(null=null), one_line=True)


def test_recover_force_leaves_a_device_node_alone(null: Path, work_dir: Path,
                                                  targets: list[TargetProcess]) -> None:
    # recover --force once truncated the node and, when fallocate failed on it, unlinked it.
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    res = cli("recover", null, "--from", f"{targets[0].address}/app", "--force")
    assert res.returncode == 1, res
    assert_clean_error(res, rf"{null} is a character device but not device DAX", one_line=True)
    assert stat.S_ISCHR(os.lstat(null).st_mode)


def test_promote_onto_a_device_that_is_not_device_dax_claims_nothing(
        null: Path, work_dir: Path, targets: list[TargetProcess]) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    before = [probe_epoch(t) for t in targets]
    assert None not in before, before  # mkfs claimed each (a promote would raise it)
    res = cli("promote", null, "--from", f"{targets[0].address}/app", "--force")
    assert res.returncode == 1, res
    assert_clean_error(res, rf"{null} is a character device but not device DAX.*nothing was claimed",
                       one_line=True)
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert [probe_epoch(t) for t in targets] == before  # the old primary is not fenced


def test_a_pool_set_whose_part_is_auto_needs_a_device_dax(null: Path, tmp_path: Path) -> None:
    # AUTO (PMDK's size of a device DAX part) takes the device's size; a file has none to take.
    poolset = tmp_path / "app.set"
    poolset.write_text(f"PMEMPOOLSET\nAUTO {tmp_path}/app.pool\n")
    res = cli("mkfs", poolset)
    assert res.returncode == 1, res
    assert_clean_error(res, r"its part \S+app.pool has size AUTO, which means a whole device DAX, and "
                       "it is none: give the pool's size instead", one_line=True)
    assert not (tmp_path / "app.pool").exists()
    poolset.write_text(f"PMEMPOOLSET\nAUTO {null}\n")
    assert_clean_error(cli("mkfs", poolset), rf"{null} is a character device but not device DAX",
                       one_line=True)
    assert stat.S_ISCHR(os.lstat(null).st_mode)
