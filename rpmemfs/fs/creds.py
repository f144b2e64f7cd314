"""Who makes a call, as far as the filesystem's own rules need it: the setgid bit is kept
only for a caller in the file's group or holding CAP_FSETID (in_group_or_capable in Linux).
The FUSE edge builds one from the request (rpmemfs/callers.py); unit tests build them by hand.
suidgid_to_clear is that rule applied to a write, truncate or chown.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from typing import Protocol


class Caller(Protocol):
    uid: int  # fsuid
    gid: int  # fsgid

    def in_group_or_capable(self, gid: int) -> bool: ...

    def capable_fsetid(self) -> bool: ...


@dataclass
class Creds:
    """A caller known in full."""

    uid: int
    gid: int
    groups: frozenset[int] = field(default_factory=frozenset)
    fsetid: bool = False  # CAP_FSETID in its effective set

    def in_group_or_capable(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups or self.fsetid

    def capable_fsetid(self) -> bool:
        return self.fsetid


ROOT = Creds(0, 0, fsetid=True)


def suidgid_to_clear(mode: int, gid: int, caller: Caller, new_gid: int | None = None) -> int:
    """Which of setuid and setgid a write, truncate or chown by ``caller`` takes from a
    non-directory of ``mode`` and group ``gid``, once the kernel has said that it must (it
    checks CAP_FSETID itself for a write or truncate, and asks on every chown, root's too).

    Linux's rules: setuid always goes (setattr_should_drop_suidgid; chown_common); setgid
    when the group may execute or the caller is neither in the file's group nor capable
    (setattr_should_drop_sgid). A chown to ``new_gid`` that takes setuid is, to the kernel, a
    chmod as well, and setattr_prepare keeps setgid through one only for a caller in the new
    group or capable: a caller with CAP_CHOWN but without CAP_FSETID loses it there."""
    kill = mode & stat.S_ISUID
    # The caller's groups are asked for only when setgid is there to lose: they may cost a
    # read of /proc.
    if mode & stat.S_ISGID and (
            mode & stat.S_IXGRP or not caller.in_group_or_capable(gid)
            or kill and new_gid is not None and not caller.in_group_or_capable(new_gid)):
        kill |= stat.S_ISGID
    return kill
