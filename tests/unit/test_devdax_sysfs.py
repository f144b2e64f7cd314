"""Telling a device DAX from other character devices, and its size and alignment (devdax.py),
over a fake sysfs tree laid out as Linux 6.1 lays out /sys/dev/char for /dev/dax0.1 (and as
kernels before 5.1 and 5.10 did), and over this machine's own /dev/null."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rpmemfs import devdax
from rpmemfs.devdax import DaxDevice, DevDaxError

RDEV = os.makedev(252, 1)
MiB = 1 << 20


def chardev(rdev: int = RDEV) -> os.stat_result:
    return os.stat_result((stat.S_IFCHR | 0o600, 1, 5, 1, 0, 0, 0, 0, 0, 0), {"st_rdev": rdev})


def fake_sysfs(root: Path, subsystem: str = "../../../../bus/dax", **files: str) -> Path:
    """/sys/dev/char/252:1 as a directory of its own (sysfs has it as a link to the device's)."""
    d = root / "dev" / "char" / "252:1"
    d.mkdir(parents=True)
    (d / "subsystem").symlink_to(subsystem)
    for name, text in files.items():
        path = d / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def test_a_device_dax_gives_its_size_and_alignment(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, size=str(62 * MiB), align=str(2 * MiB))
    assert devdax.subsystem(RDEV, str(root)) == "dax"
    assert devdax.describe("/dev/dax0.1", chardev(), str(root)) == DaxDevice("/dev/dax0.1", 62 * MiB, 2 * MiB)


def test_older_kernels_layouts_are_read(tmp_path: Path) -> None:
    # Before 5.1 the subsystem was the dax class; before 5.10 the alignment was the parent's.
    root = fake_sysfs(tmp_path, "../../../../class/dax", size=str(1 << 30), device__align=str(1 << 30))
    assert devdax.describe("/dev/dax0.1", chardev(), str(root)).align == 1 << 30


def test_another_character_device_is_refused_saying_what_it_is(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, "../../../../class/mem", size="0")
    with pytest.raises(DevDaxError, match=r"/dev/x is a character device but not device DAX .*'mem'"):
        devdax.describe("/dev/x", chardev(), str(root))
    # One sysfs does not know at all (a device of another machine's numbering).
    with pytest.raises(DevDaxError, match="no subsystem"):
        devdax.describe("/dev/x", chardev(os.makedev(9, 9)), str(root))


@pytest.mark.parametrize(("files", "why"), [
    ({"align": str(2 * MiB)}, "gives no size"),
    ({"size": "garbage", "align": str(2 * MiB)}, "gives no size"),
    ({"size": str(3 * MiB), "align": str(2 * MiB)}, "not a whole number of its alignment 2097152"),
    ({"size": str(6 * MiB), "align": str(3 * MiB)}, "not a whole number of its alignment"),
])
def test_a_size_that_cannot_be_mapped_whole_is_refused(tmp_path: Path, files: dict[str, str],
                                                       why: str) -> None:
    root = fake_sysfs(tmp_path, **files)
    with pytest.raises(DevDaxError, match=why):
        devdax.describe("/dev/dax0.1", chardev(), str(root))


def test_without_an_alignment_in_sysfs_it_is_2m(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, size=str(64 * MiB))
    assert devdax.describe("/dev/dax0.1", chardev(), str(root)).align == devdax.DEFAULT_ALIGN


def test_probe_on_files_and_on_this_machines_dev_null(tmp_path: Path) -> None:
    f = tmp_path / "pool"
    f.write_bytes(b"x")
    assert devdax.probe(str(f)) is None
    assert devdax.probe(str(tmp_path / "missing")) is None
    assert not devdax.is_char_device(str(f))
    if stat.S_ISCHR(os.stat("/dev/null").st_mode):
        assert devdax.is_char_device("/dev/null")
        with pytest.raises(DevDaxError, match="/dev/null is a character device but not device DAX"):
            devdax.probe("/dev/null")
