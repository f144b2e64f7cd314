"""The kernel's mount table (/proc/self/mountinfo), read in one place.

The CLI asks it whether a pool is mounted somewhere, the tools and tests whether a path is a
mount point and which mounts sit below a directory. The table answers without touching the
filesystem on a mount: os.path.ismount stats the mount point, which hangs while a FUSE daemon
is stuck and says False once it died (ENOTCONN), while the table still lists the mount.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str  # "fuse.rpmemfs", "tmpfs", ...
    source: str  # for an rpmemfs mount "rpmemfs:" + the pool's path
    mount_id: int = 0
    parent_id: int = 0  # a mount stacked on another at the same point has it as its parent


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash as \ooo (octal).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_line(line: str) -> MountEntry | None:
    """One line of mountinfo: ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - TYPE
    SOURCE SUPER_OPTS. None for a line that does not have that shape."""
    fields = line.split()
    try:
        sep = fields.index("-", 6)
        return MountEntry(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]),
                          int(fields[0]), int(fields[1]))
    except (ValueError, IndexError):
        return None


def mounts() -> list[MountEntry]:
    """Every mount this process sees, in the kernel's order (parents before children)."""
    with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
        return [e for e in map(parse_line, f) if e is not None]


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a mount point (also a FUSE mount whose daemon died)."""
    target = os.path.realpath(path)
    return any(e.mountpoint == target for e in mounts())


def mount_at(point: str) -> MountEntry | None:
    """The mount on top at ``point`` (a path as the table writes it: absolute, resolved), if
    any: the one a path lookup, and an unmount, reaches."""
    here = [e for e in mounts() if e.mountpoint == point]
    below = {e.parent_id for e in here}
    top = [e for e in here if e.mount_id not in below]
    return top[-1] if top else None


def mounts_under(root: str | os.PathLike[str]) -> list[str]:
    """Mount points at or below ``root``, deepest first (the order to detach them in)."""
    base = os.path.realpath(root)
    found = [e.mountpoint for e in mounts()
             if e.mountpoint == base or e.mountpoint.startswith(base.rstrip("/") + "/")]
    return sorted(found, key=len, reverse=True)


def fs_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding ``path`` (its deepest mount), "unknown" if none."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    for e in mounts():
        point = e.mountpoint
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, e.fstype
    return best_type


def mounted_from(source: str) -> str | None:
    """The mount point of the mount whose source is ``source``, if one is mounted now."""
    for e in mounts():
        if e.source == source:
            return e.mountpoint
    return None
