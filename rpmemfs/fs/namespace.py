"""The namespace: names in directories (lookup, create, link, unlink, rename, readdir) and the
lifetime of inodes (opens, kernel references, freeing the ones nobody names or holds).

A namespace change is logged at once, as one record with the state of every inode it
touched (rpmemfs.fs.changes commit), so that a crash never shows half a rename. An inode
that loses its last name lives on while it is open or the kernel holds it, and is freed by
the record of the change that lets go of it last (or, after a crash, at the next mount).
"""

from __future__ import annotations

import errno
import stat
import time

from rpmemfs.fs import records as R
from rpmemfs.fs.attrs import Attributes
from rpmemfs.fs.changes import ChangeTracker
from rpmemfs.fs.creds import ROOT, Caller
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.replay import ROOT_INO, Index

NAME_MAX = 255


class Namespace:
    """The directories and inode lifetimes of one mounted pool. ``open_files`` is the sum of
    every inode's opens, kept as they change."""

    def __init__(self, index: Index, changes: ChangeTracker, attrs: Attributes) -> None:
        self.index = index
        self.inodes = index.inodes
        self.node = index.node
        self.changes = changes
        self.attrs = attrs
        self.open_files = 0

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    def lookup(self, parent: int, name: bytes) -> Inode:
        pnode = self.index.directory(parent)
        if name == b".":
            return pnode
        if name == b"..":
            return self.node(pnode.parent or ROOT_INO)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        assert pnode.children is not None
        ino = pnode.children.get(name)
        if ino is None:
            raise FsError(errno.ENOENT)
        return self.inodes[ino]

    def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        node = self.index.directory(ino)
        assert node.children is not None
        return list(node.children.items())

    # ---------------------------------------------------------------- making names

    def _make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
              target: bytes = b"", umask: int = 0, caller: Caller | None = None) -> Inode:
        """A new inode named ``name`` in ``parent``, owned as Linux's inode_init_owner and
        posix_acl_create make it on ext4: in a setgid directory it takes the directory's
        group (and a directory the setgid bit too); its mode and ACLs as Attributes.inherited
        says."""
        self._check_name(name)
        pnode = self.index.directory(parent)
        assert pnode.children is not None
        if name in pnode.children:
            raise FsError(errno.EEXIST)
        is_dir = stat.S_ISDIR(mode)
        if pnode.mode & stat.S_ISGID:
            if is_dir:
                mode |= stat.S_ISGID
            elif (mode & (stat.S_ISGID | stat.S_IXGRP) == stat.S_ISGID | stat.S_IXGRP
                  and not (caller or ROOT).in_group_or_capable(pnode.gid)):
                mode &= ~stat.S_ISGID  # mode_strip_sgid: not a member of the group it gets
            gid = pnode.gid
        mode, xattrs = self.attrs.inherited(pnode, mode, umask)
        xbytes = sum(R.XSET.size + len(k) + len(v) + 8 for k, v in xattrs.items())
        changes = self.changes
        changes.new_inode_room(R.INODE.size * 2 + R.LINK.size + len(name) + len(target) + 16 + xbytes)
        now = time.time_ns()
        ino = self.index.next_ino
        self.index.next_ino += 1
        node = Inode(ino, mode, uid, gid, 2 if is_dir else 1, rdev, len(target), now, now, now)
        self.inodes[ino] = node
        entries: list[bytes] = []
        if target:
            node.target = target
            entries.append(R.symlink(ino, target))
        if is_dir:
            node.parent = parent
            pnode.nlink += 1
        pnode.children[name] = ino
        pnode.tick(mtime=True)
        changes.touch(node)
        changes.touch(pnode)
        for k, v in xattrs.items():
            node.xattrs[k] = v
            changes.map_change(node, R.xset(ino, k, v))
        entries.append(R.link(parent, name, ino))
        changes.commit(entries)
        return node

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
               rdev: int = 0, umask: int = 0, caller: Caller | None = None) -> Inode:
        return self._make(parent, name, mode, uid, gid, rdev, umask=umask, caller=caller)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int, umask: int = 0,
              caller: Caller | None = None) -> Inode:
        return self._make(parent, name, (mode & 0o7777) | stat.S_IFDIR, uid, gid, umask=umask,
                          caller=caller)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self._make(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        self._check_name(name)
        node = self.node(ino)
        if node.is_dir:
            raise FsError(errno.EPERM)
        pnode = self.index.directory(parent)
        assert pnode.children is not None
        if name in pnode.children:
            raise FsError(errno.EEXIST)
        changes = self.changes
        changes.room(R.INODE.size * 2 + R.LINK.size + len(name) + 8)
        node.nlink += 1
        node.tick()
        pnode.children[name] = ino
        pnode.tick(mtime=True)
        changes.touch(node)
        changes.touch(pnode)
        changes.commit([R.link(parent, name, ino)])
        return node

    # ---------------------------------------------------------------- removing names

    def unlink(self, parent: int, name: bytes) -> None:
        node = self.lookup(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        self._remove(parent, name, node)

    def rmdir(self, parent: int, name: bytes) -> None:
        if name == b".":
            raise FsError(errno.EINVAL)
        node = self.lookup(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        if node.ino == ROOT_INO:
            raise FsError(errno.EBUSY)
        self._remove(parent, name, node)

    def _remove(self, parent: int, name: bytes, node: Inode) -> None:
        changes = self.changes
        changes.room(R.INODE.size * 2 + R.UNLINK.size + len(name) + R.FREE.size + 8)
        pnode = self.inodes[parent]
        assert pnode.children is not None
        del pnode.children[name]
        self._drop_name(node, pnode)
        pnode.tick(mtime=True)
        changes.touch(pnode)
        entries = [R.unlink(parent, name)]
        freed = self.free_if_unused(node)
        entries.extend(freed)
        changes.commit(entries, freeing=[node.ino] if freed else None)

    def _drop_name(self, node: Inode, pnode: Inode) -> None:
        """``node`` lost its name in directory ``pnode`` (unlinked, or replaced by a rename):
        a directory's links all go (and its ".." in the parent), a file's one."""
        if node.is_dir:
            node.nlink = 0
            pnode.nlink -= 1
        else:
            node.nlink -= 1
        node.tick()
        self.changes.touch(node)

    def _is_ancestor(self, ino: int, of: int) -> bool:
        """Is directory ino the same as, or an ancestor of, directory `of`?"""
        cur = of
        while True:
            if cur == ino:
                return True
            if cur == ROOT_INO or cur == 0:
                return False
            cur = self.inodes[cur].parent

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        noreplace, exchange = flags & 1, flags & 2  # RENAME_NOREPLACE, RENAME_EXCHANGE
        if noreplace and exchange:
            raise FsError(errno.EINVAL)
        self._check_name(new_name)
        src = self.lookup(old_parent, old_name)
        op = self.index.directory(old_parent)
        np_ = self.index.directory(new_parent)
        assert op.children is not None and np_.children is not None
        dst_ino = np_.children.get(new_name)
        dst = self.inodes[dst_ino] if dst_ino is not None else None
        if src.is_dir and self._is_ancestor(src.ino, new_parent):
            raise FsError(errno.EINVAL)
        if exchange:
            if dst is None:
                raise FsError(errno.ENOENT)
            if dst.is_dir and self._is_ancestor(dst.ino, old_parent):
                raise FsError(errno.EINVAL)
        elif dst is not None:
            if noreplace:
                raise FsError(errno.EEXIST)
            if dst.ino == src.ino:
                return
            if src.is_dir and not dst.is_dir:
                raise FsError(errno.ENOTDIR)
            if dst.is_dir and not src.is_dir:
                raise FsError(errno.EISDIR)
            if dst.is_dir and dst.children:
                raise FsError(errno.ENOTEMPTY)
        changes = self.changes
        changes.room(R.INODE.size * 4 + 2 * (R.LINK.size + R.UNLINK.size) + len(old_name)
                     + len(new_name) + R.FREE.size + 32)
        entries: list[bytes] = []
        freeing: list[int] = []
        if exchange:
            assert dst is not None
            op.children[old_name], np_.children[new_name] = dst.ino, src.ino
            entries += [R.link(old_parent, old_name, dst.ino), R.link(new_parent, new_name, src.ino)]
            if old_parent != new_parent:
                for moved, to, frm in ((src, np_, op), (dst, op, np_)):
                    if moved.is_dir:
                        moved.parent = to.ino
                        to.nlink += 1
                        frm.nlink -= 1
            dst.tick()
            changes.touch(dst)
        else:
            if dst is not None:
                self._drop_name(dst, np_)
                freed = self.free_if_unused(dst)
                if freed:
                    freeing.append(dst.ino)
                entries += freed
            del op.children[old_name]
            np_.children[new_name] = src.ino
            entries += [R.unlink(old_parent, old_name), R.link(new_parent, new_name, src.ino)]
            if src.is_dir and old_parent != new_parent:
                src.parent = new_parent
                np_.nlink += 1
                op.nlink -= 1
        src.tick()
        op.tick(mtime=True)
        if np_ is not op:
            np_.tick(mtime=True)
        changes.touch(src)
        changes.touch(op)
        changes.touch(np_)
        changes.commit(entries, freeing=freeing or None)

    # ---------------------------------------------------------------- inode lifetimes

    def opened(self, ino: int) -> Inode:
        node = self.node(ino)
        node.opens += 1
        self.open_files += 1
        return node

    def released(self, ino: int) -> None:
        node = self.inodes.get(ino)
        if node is None:
            return
        node.opens -= 1
        self.open_files -= 1
        self._drop_if_gone(node)

    def forget(self, ino: int, n: int) -> None:
        node = self.inodes.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - n)
        self._drop_if_gone(node)

    def _drop_if_gone(self, node: Inode) -> None:
        if node.nlink == 0 and node.lookups == 0 and node.opens == 0:
            try:
                self.changes.room(R.FREE.size + 8)
            except FsError:
                return  # the orphan is reclaimed at the next mount instead
            freed = self.free_if_unused(node)
            if freed:
                self.changes.commit(freed, freeing=[node.ino])

    def free_if_unused(self, node: Inode) -> list[bytes]:
        """Entries that drop an inode nobody names or holds any more (else nothing); the
        caller commits them."""
        if node.nlink > 0 or node.lookups > 0 or node.opens > 0 or node.ino == ROOT_INO:
            return []
        self.changes.alloc.defer([(pb, n) for _fb, pb, n in node.runs()])
        del self.inodes[node.ino]
        self.changes.discard(node)
        return [R.free(node.ino)]
