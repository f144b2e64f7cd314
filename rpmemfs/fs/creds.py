"""Who makes a call, as far as the filesystem's own rules need it: the setgid bit is kept
only for a caller in the file's group or holding CAP_FSETID (in_group_or_capable in Linux).
The FUSE edge builds one from the request (rpmemfs/callers.py); unit tests build them by hand.
"""

from __future__ import annotations

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
