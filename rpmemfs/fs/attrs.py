"""Attributes of inodes: setattr (mode, owner, size, times), setuid/setgid clearing, extended
attributes, and POSIX ACLs kept in step with modes and inherited from default ACLs.

What ext4 does beside the kernel's permission checks is done here (the rules themselves are
rpmemfs.fs.acl and rpmemfs.fs.creds); every change goes to the log through the change
tracker (rpmemfs.fs.changes), a mode and the ACL it rewrites in one record.
"""

from __future__ import annotations

import errno
import logging
import stat

from rpmemfs.fs import acl as A
from rpmemfs.fs import records as R
from rpmemfs.fs.changes import ChangeTracker
from rpmemfs.fs.creds import ROOT, Caller, suidgid_to_clear
from rpmemfs.fs.data import Data
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.replay import Index

log = logging.getLogger("rpmemfs.fs")


class Attributes:
    """``posix_acl``: ACLs are kept in step with modes and inherited from default ACLs; off
    when the mount has no xattrs (then nothing can set one, and the kernel checks modes only).
    """

    def __init__(self, index: Index, changes: ChangeTracker, data: Data) -> None:
        self.node = index.node
        self.changes = changes
        self.data = data
        self.posix_acl = True

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime: int | None = None,
                mtime: int | None = None, atime_now: bool = False, mtime_now: bool = False,
                kill_suidgid: Caller | None = None) -> Inode:
        """Change attributes. A time given is stored as given (utimensat with a value: it may
        go back, as on ext4); ``*_now`` (UTIME_NOW, touch) takes this inode's next tick
        instead of the kernel's time, so that it never goes before the last change. A new
        mode rewrites the access ACL's owner, group (or mask) and other entries to match.
        ``kill_suidgid``: the kernel asks that setuid/setgid be cleared as this caller's chown
        or truncate clears them (see kill_suidgid); a mode given along still wins."""
        node = self.node(ino)
        if kill_suidgid is not None:
            self.kill_suidgid(node, kill_suidgid, new_gid=gid)
        acl_value = node.xattrs.get(A.ACCESS) if self.posix_acl and mode is not None else None
        self.changes.room(R.INODE.size + R.TRUNC.size
                          + (R.XSET.size + len(A.ACCESS) + len(acl_value) + 8 if acl_value else 0))
        if size is not None and size != node.size:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not node.is_reg:
                raise FsError(errno.EINVAL)
            self.data.truncate(node, size)
        if mode is not None:
            node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
            if acl_value is not None:
                acl = A.chmod(A.parse(acl_value), node.mode)
                value = A.encode(acl)
                node.xattrs[A.ACCESS] = value
                self.changes.map_change(node, R.xset(ino, A.ACCESS, value))
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        now = node.tick()
        if atime_now:
            node.atime = now
        elif atime is not None:
            node.atime = atime
        if mtime_now:
            node.mtime = now
        elif mtime is not None:
            node.mtime = mtime
        self.changes.touch(node)
        return node

    def kill_suidgid(self, node: Inode, caller: Caller, new_gid: int | None = None) -> None:
        """Clear setuid and setgid as the kernel would for a write or truncate by ``caller``
        that it already found lacks CAP_FSETID, or for a chown (to ``new_gid``, if the group
        changes) by anyone, root included: see suidgid_to_clear. The kernel asks for it
        (FUSE_HANDLE_KILLPRIV_V2) and leaves it to us; a chown asks for every non-directory,
        FIFOs, devices and sockets as well as regular files."""
        if node.is_dir:
            return
        kill = suidgid_to_clear(node.mode, node.gid, caller, new_gid)
        if kill:
            node.mode &= ~kill
            node.tick()
            self.changes.touch(node)

    def open_truncate(self, ino: int, caller: Caller) -> Inode:
        """open(O_TRUNC): the kernel sends no setattr (atomic O_TRUNC), so what its truncate
        does is done here: size 0, new mtime, and setuid/setgid cleared as a write by the
        caller would clear them (should_remove_suid)."""
        node = self.node(ino)
        self.changes.room(R.INODE.size + R.TRUNC.size)
        if node.is_reg and node.mode & (stat.S_ISUID | stat.S_ISGID) and not caller.capable_fsetid():
            node.mode &= ~suidgid_to_clear(node.mode, node.gid, caller)
        if node.size:
            self.data.truncate(node, 0)
        else:
            node.tick(mtime=True)
            self.changes.touch(node)
        return node

    # ---------------------------------------------------------------- xattrs

    def setxattr(self, ino: int, name: bytes, value: bytes, caller: Caller | None = None) -> None:
        node = self.node(ino)
        if len(name) > 255:
            raise FsError(errno.ERANGE)
        if len(value) > 65536:
            raise FsError(errno.E2BIG)
        if name in A.NAMES and self.posix_acl:
            self._set_acl(node, name, value, caller or ROOT)
            return
        self.changes.new_inode_room(R.XSET.size + len(name) + len(value) + R.INODE.size + 8)
        node.xattrs[name] = value
        node.tick()
        self.changes.map_change(node, R.xset(ino, name, value))

    def _set_acl(self, node: Inode, name: bytes, value: bytes, caller: Caller) -> None:
        """An ACL set as ext4 sets it (ext4_set_acl, posix_acl_update_mode): an access ACL
        gives the mode its permission bits, and is not kept when it says no more than they
        do; setgid is cleared unless the caller is in the file's group or has CAP_FSETID.
        The mode and the ACL go into one log record."""
        if not A.applies_to(node.mode):
            raise FsError(errno.EOPNOTSUPP)
        acl = A.parse(value)
        if name == A.DEFAULT and not node.is_dir:
            if acl:
                raise FsError(errno.EACCES)  # as set_posix_acl answers
            return
        self.changes.new_inode_room(R.XSET.size + len(name) + len(value) + R.INODE.size + 8)
        keep: bytes | None = A.encode(acl) if acl else None
        if name == A.ACCESS and acl:
            equivalent, mode = A.equiv_mode(acl, node.mode)
            if not caller.in_group_or_capable(node.gid):
                mode &= ~stat.S_ISGID
            node.mode = mode
            if equivalent:
                keep = None
        if keep is not None:
            node.xattrs[name] = keep
            self.changes.map_change(node, R.xset(node.ino, name, keep))
        elif name in node.xattrs:
            del node.xattrs[name]
            self.changes.map_change(node, R.xdel(node.ino, name))
        node.tick()
        self.changes.touch(node)

    def getxattr(self, ino: int, name: bytes) -> bytes | None:
        """The value, or None when the inode has no such attribute (ENODATA to the caller:
        the kernel asks for security.capability before every write, so no exception here)."""
        return self.node(ino).xattrs.get(name)

    def removexattr(self, ino: int, name: bytes) -> None:
        node = self.node(ino)
        if name not in node.xattrs:
            raise FsError(errno.ENODATA)
        self.changes.room(R.XDEL.size + len(name) + R.INODE.size + 8)
        del node.xattrs[name]
        node.tick()
        self.changes.map_change(node, R.xdel(ino, name))

    # ---------------------------------------------------------------- new inodes

    def inherited(self, pnode: Inode, mode: int, umask: int) -> tuple[int, dict[bytes, bytes]]:
        """The mode and the ACLs of a new inode in directory ``pnode``, as posix_acl_create
        makes them on ext4: under a default ACL it gets an access ACL and a mode from it and
        the requested mode (a directory the default ACL too), and the umask is not applied;
        without one the umask is (FUSE_DONT_MASK: the kernel leaves it to us). Symlinks get
        neither."""
        is_dir = stat.S_ISDIR(mode)
        xattrs: dict[bytes, bytes] = {}
        if stat.S_ISLNK(mode):
            return mode, xattrs
        default = self._default_acl(pnode)
        if default is None:
            return mode & ~(umask & 0o777), xattrs
        access, mode = A.create(default, mode)
        if access is not None:
            xattrs[A.ACCESS] = A.encode(access)
        if is_dir:
            xattrs[A.DEFAULT] = pnode.xattrs[A.DEFAULT]
        return mode, xattrs

    def _default_acl(self, pnode: Inode) -> A.Acl | None:
        """The directory's default ACL, when ACLs are on and it has a valid one."""
        value = pnode.xattrs.get(A.DEFAULT) if self.posix_acl else None
        if value is None:
            return None
        try:
            return A.parse(value) or None
        except FsError:
            log.warning("inode %d: its default ACL is malformed; new entries ignore it", pnode.ino)
            return None
