"""Device DAX (/dev/daxX.Y): telling one from other character devices, and its size and alignment.

A device DAX is a namespace of persistent memory handed to user space whole, with no file
system under it. It is mapped like a file, but only shared and only in whole units of its
alignment (the mapping's start and length both; the kernel picks an aligned start itself),
and it is always synchronous: a store is durable once its cache line is written back and
fenced, and there is nothing to msync (the kernel answers msync and fsync with EINVAL).

What the kernel says about one is in sysfs, in the directory /sys/dev/char/MAJOR:MINOR: its
``subsystem`` links to the dax bus (``.../bus/dax``; ``.../class/dax`` on kernels before 5.1),
``size`` is its size in bytes, ``align`` (Linux 5.10 and later; ``device/align`` before, as
PMDK reads it) its alignment. Everything is read from a sysfs root the caller may give, so
that the unit tests can hand it a fake tree.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from rpmemfs.errors import RpmemfsError

SYSFS = "/sys"
# Where sysfs says nothing about alignment (no kernel we know of): the size every device DAX
# namespace of ndctl's default has.
DEFAULT_ALIGN = 2 << 20


class DevDaxError(RpmemfsError):
    """The path is a character device that cannot serve as a pool (not device DAX, or sysfs
    says something unusable about it)."""


@dataclass(frozen=True)
class DaxDevice:
    path: str
    size: int  # bytes, a whole number of ``align``
    align: int


def sysfs_dir(rdev: int, root: str = SYSFS) -> str:
    return os.path.join(root, "dev", "char", f"{os.major(rdev)}:{os.minor(rdev)}")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip(), 0)
    except (OSError, ValueError):
        return None


def subsystem(rdev: int, root: str = SYSFS) -> str:
    """The last component of the device's sysfs subsystem link ('dax', 'mem', ...), or ''."""
    try:
        return os.path.basename(os.readlink(os.path.join(sysfs_dir(rdev, root), "subsystem")))
    except OSError:
        return ""


def is_char_device(path: str) -> bool:
    """Whether ``path`` (symbolic links followed) is a character device."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def describe(path: str, st: os.stat_result, root: str = SYSFS) -> DaxDevice:
    """The device DAX that ``st`` (an fstat of ``path``, a character device) is; DevDaxError
    when it is another kind of device, or sysfs gives no usable size or alignment."""
    rdev = st.st_rdev
    where = sysfs_dir(rdev, root)
    kind = subsystem(rdev, root)
    if kind != "dax":
        raise DevDaxError(
            f"{path} is a character device but not device DAX (sysfs puts {os.major(rdev)}:"
            f"{os.minor(rdev)} under {kind or 'no subsystem'!r}, not 'dax'): a pool is a file, or "
            "a device DAX namespace (/dev/daxX.Y, made with ndctl create-namespace -m devdax)")
    size = _read_int(os.path.join(where, "size"))
    if not size or size < 0:
        raise DevDaxError(f"device DAX {path}: sysfs gives no size for it ({where}/size)")
    align = _read_int(os.path.join(where, "align")) or _read_int(os.path.join(where, "device", "align"))
    align = align or DEFAULT_ALIGN
    if align & (align - 1) or size % align:
        raise DevDaxError(f"device DAX {path}: its size {size} is not a whole number of its "
                          f"alignment {align}; it cannot be mapped whole")
    return DaxDevice(path, size, align)


def probe(path: str, root: str = SYSFS) -> DaxDevice | None:
    """The device DAX at ``path``; None when ``path`` is no character device (a file, or
    nothing); DevDaxError when it is a character device of another kind."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return describe(path, st, root)
