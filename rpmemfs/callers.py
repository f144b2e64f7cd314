"""The caller of a FUSE request, as rpmemfs.fs.creds.Caller: its fsuid and fsgid come with
the request; its supplementary groups and CAP_FSETID only from /proc/PID/status, read once
and only when a rule needs them (keeping setgid on an ACL change or a create in a setgid
directory), which is rare.

A caller that has exited, or whose pid the daemon cannot see (another pid namespace: FUSE
sends 0 then), counts by its fsgid alone and without CAP_FSETID, unless its fsuid is 0:
clearing setgid wrongly is the safer side.
"""

from __future__ import annotations

import logging

log = logging.getLogger("rpmemfs.fuse")

CAP_FSETID = 4


class ProcCaller:
    __slots__ = ("uid", "gid", "pid", "_groups", "_fsetid")

    def __init__(self, uid: int, gid: int, pid: int) -> None:
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self._groups: frozenset[int] | None = None
        self._fsetid = False

    def _load(self) -> frozenset[int]:
        if self._groups is None:
            self._groups, self._fsetid = frozenset(), self.uid == 0
            if self.pid > 0:
                try:
                    with open(f"/proc/{self.pid}/status", encoding="ascii", errors="replace") as f:
                        status = f.read()
                except OSError:
                    log.debug("caller %d gone: only its fsgid counts", self.pid)
                else:
                    self._groups, self._fsetid = parse_status(status)
        return self._groups

    def in_group_or_capable(self, gid: int) -> bool:
        if gid == self.gid:
            return True
        groups = self._load()
        return gid in groups or self._fsetid

    def capable_fsetid(self) -> bool:
        self._load()
        return self._fsetid


def parse_status(status: str) -> tuple[frozenset[int], bool]:
    """Supplementary groups and whether CAP_FSETID is effective, from /proc/PID/status."""
    groups: frozenset[int] = frozenset()
    fsetid = False
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key == "Groups":
            groups = frozenset(int(g) for g in value.split())
        elif key == "CapEff":
            fsetid = bool(int(value.strip() or "0", 16) >> CAP_FSETID & 1)
    return groups, fsetid
