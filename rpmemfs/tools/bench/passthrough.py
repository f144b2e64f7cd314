"""A minimal pass-through FUSE filesystem: the baseline rpmemfs is measured against.

It runs on the same stack as rpmemfs (pyfuse3 + trio, same kernel options, same cache
settings), so the difference between the two is what rpmemfs itself does, not FUSE or
Python. Every request ends in a real syscall on the source tree; nothing is cached or
skipped here that the kernel would not cache for rpmemfs as well.

    python -m rpmemfs.tools.bench.passthrough [--xattr] SRC MNT

Without --xattr it implements no xattr operations: the first ENOSYS makes the kernel
stop asking, in particular for "security.capability" before every write(2). With
--xattr, getxattr/setxattr/listxattr/removexattr go to the source files, so it pays
that round trip like any filesystem offering xattrs (rpmemfs without noxattr).

Readiness is signalled by MNT becoming a mount point; SIGTERM or SIGINT unmount cleanly.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyfuse3
import trio
from pyfuse3 import FUSEError

# Kernel caches entries and attributes for the same time as rpmemfs, so both see the
# same number of LOOKUP/GETATTR round trips.
ENTRY_TIMEOUT = 1.0
ATTR_TIMEOUT = 1.0

# The kernel computes the offset of an O_APPEND write itself and sends it to us; if the
# source fd were O_APPEND too, Linux's pwrite would ignore that offset.
_OPEN_FLAGS_DROPPED = os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOCTTY


def _errno_of(exc: OSError) -> FUSEError:
    return FUSEError(exc.errno if exc.errno is not None else errno.EIO)


@dataclass
class _DirHandle:
    path: str
    # Snapshot taken on the first readdir, so offsets stay stable while the kernel
    # reads the listing in several batches.
    entries: list[tuple[str, os.stat_result]] | None = None


@dataclass
class _InodeTable:
    """Maps the kernel's inode numbers (the source's st_ino, root aside) to paths."""

    root: str
    paths: dict[int, str] = field(default_factory=dict)
    lookups: dict[int, int] = field(default_factory=dict)
    open_fds: dict[int, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.paths[pyfuse3.ROOT_INODE] = self.root

    def path(self, ino: int) -> str:
        try:
            return self.paths[ino]
        except KeyError:
            raise FUSEError(errno.ENOENT) from None

    def remember(self, ino: int, path: str) -> None:
        self.paths[ino] = path
        self.lookups[ino] = self.lookups.get(ino, 0) + 1

    def forget(self, ino: int, count: int) -> None:
        left = self.lookups.get(ino, 0) - count
        if left > 0:
            self.lookups[ino] = left
            return
        self.lookups.pop(ino, None)
        if ino != pyfuse3.ROOT_INODE:
            self.paths.pop(ino, None)

    def renamed(self, old: str, new: str) -> None:
        # Paths are stored whole, so moving a directory must move every known
        # path below it too.
        prefix = old + os.sep
        for ino, path in list(self.paths.items()):
            if path == old:
                self.paths[ino] = new
            elif path.startswith(prefix):
                self.paths[ino] = new + path[len(old):]


class Passthrough(pyfuse3.Operations):
    # Same as rpmemfs: without it every write() goes to the daemon synchronously,
    # which is the behaviour being compared.
    enable_writeback_cache = False

    def __init__(self, source: str) -> None:
        super().__init__()
        self._inodes = _InodeTable(os.path.abspath(source))
        self._dirs: dict[int, _DirHandle] = {}
        self._next_dir_fh = 1
        self._fd_inode: dict[int, int] = {}

    # --- attributes -------------------------------------------------------------

    def _ino_of(self, path: str, st: os.stat_result) -> int:
        if path == self._inodes.root:
            return pyfuse3.ROOT_INODE
        if st.st_ino == pyfuse3.ROOT_INODE:
            # Would alias the kernel's root inode; no real source tree hits this.
            raise FUSEError(errno.EIO)
        return st.st_ino

    def _entry(self, ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = ino
        entry.generation = 0
        entry.entry_timeout = ENTRY_TIMEOUT
        entry.attr_timeout = ATTR_TIMEOUT
        entry.st_mode = st.st_mode
        entry.st_nlink = st.st_nlink
        entry.st_uid = st.st_uid
        entry.st_gid = st.st_gid
        entry.st_rdev = st.st_rdev
        entry.st_size = st.st_size
        entry.st_blksize = st.st_blksize
        entry.st_blocks = st.st_blocks
        entry.st_atime_ns = st.st_atime_ns
        entry.st_mtime_ns = st.st_mtime_ns
        entry.st_ctime_ns = st.st_ctime_ns
        return entry

    def _stat_ino(self, ino: int) -> os.stat_result:
        fds = self._inodes.open_fds.get(ino)
        try:
            if fds:
                # An open file may have lost its name (unlinked while open).
                return os.fstat(next(iter(fds)))
            return os.lstat(self._inodes.path(ino))
        except OSError as exc:
            raise _errno_of(exc) from None

    def _new_entry(self, path: str) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise _errno_of(exc) from None
        ino = self._ino_of(path, st)
        self._inodes.remember(ino, path)
        return self._entry(ino, st)

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._inodes.path(parent), os.fsdecode(name))

    def _chown_to_caller(self, path: str, ctx: pyfuse3.RequestContext) -> None:
        # Only when the caller is not the daemon's own user: the owner is then
        # already right and the extra syscall would be pure overhead.
        if (ctx.uid, ctx.gid) != (os.geteuid(), os.getegid()):
            os.chown(path, ctx.uid, ctx.gid, follow_symlinks=False)

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._new_entry(self._child(parent_inode, name))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self._inodes.forget(ino, count)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(inode, self._stat_ino(inode))

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        # The f* variants work on files that are open but no longer have a name.
        target: int | str = fh if fh is not None else self._inodes.path(inode)
        try:
            if fields.update_size:
                os.truncate(target, attr.st_size)
            if fields.update_mode:
                os.chmod(target, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                uid = attr.st_uid if fields.update_uid else -1
                gid = attr.st_gid if fields.update_gid else -1
                os.chown(target, uid, gid)
            if fields.update_atime or fields.update_mtime:
                # utime sets both stamps at once; keep the one not being changed.
                old = os.stat(target)
                atime = attr.st_atime_ns if fields.update_atime else old.st_atime_ns
                mtime = attr.st_mtime_ns if fields.update_mtime else old.st_mtime_ns
                os.utime(target, ns=(atime, mtime))
        except OSError as exc:
            raise _errno_of(exc) from None
        return self._entry(inode, self._stat_ino(inode))

    # --- files ------------------------------------------------------------------

    def _opened(self, ino: int, fd: int) -> pyfuse3.FileInfo:
        self._fd_inode[fd] = ino
        self._inodes.open_fds.setdefault(ino, set()).add(fd)
        return pyfuse3.FileInfo(fh=fd, keep_cache=True)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        try:
            fd = os.open(self._inodes.path(inode), flags & ~_OPEN_FLAGS_DROPPED)
        except OSError as exc:
            raise _errno_of(exc) from None
        return self._opened(inode, fd)

    async def create(
        self,
        parent_inode: int,
        name: bytes,
        mode: int,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        open_flags = (flags & ~_OPEN_FLAGS_DROPPED) | os.O_CREAT | (flags & os.O_EXCL)
        try:
            fd = os.open(path, open_flags, mode & ~ctx.umask)
            self._chown_to_caller(path, ctx)
            st = os.fstat(fd)
        except OSError as exc:
            raise _errno_of(exc) from None
        ino = self._ino_of(path, st)
        self._inodes.remember(ino, path)
        return self._opened(ino, fd), self._entry(ino, st)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        try:
            return os.pread(fh, size, off)
        except OSError as exc:
            raise _errno_of(exc) from None

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        view = memoryview(buf)
        done = 0
        try:
            # Without direct_io the kernel expects the whole buffer to be written.
            while done < len(view):
                done += os.pwrite(fh, view[done:], off + done)
        except OSError as exc:
            raise _errno_of(exc) from None
        return done

    async def flush(self, fh: int) -> None:
        # close() of a dup reports the same deferred errors a close of the
        # original would, without giving up the fd that release() still needs.
        try:
            os.close(os.dup(fh))
        except OSError as exc:
            raise _errno_of(exc) from None

    async def release(self, fh: int) -> None:
        ino = self._fd_inode.pop(fh, None)
        if ino is not None:
            fds = self._inodes.open_fds.get(ino)
            if fds is not None:
                fds.discard(fh)
                if not fds:
                    del self._inodes.open_fds[ino]
        try:
            os.close(fh)
        except OSError as exc:
            raise _errno_of(exc) from None

    async def fsync(self, fh: int, datasync: bool) -> None:
        try:
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)
        except OSError as exc:
            raise _errno_of(exc) from None

    # --- directories ------------------------------------------------------------

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        fh = self._next_dir_fh
        self._next_dir_fh += 1
        self._dirs[fh] = _DirHandle(self._inodes.path(inode))
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._dirs[fh]
        if handle.entries is None or start_id == 0:
            try:
                with os.scandir(handle.path) as it:
                    names = sorted(e.name for e in it)
                handle.entries = [
                    (n, os.lstat(os.path.join(handle.path, n))) for n in names
                ]
            except OSError as exc:
                raise _errno_of(exc) from None
        for index in range(start_id, len(handle.entries)):
            name, st = handle.entries[index]
            path = os.path.join(handle.path, name)
            ino = self._ino_of(path, st)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(ino, st), index + 1):
                return
            self._inodes.remember(ino, path)

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        try:
            os.mkdir(path, mode & ~ctx.umask)
            self._chown_to_caller(path, ctx)
        except OSError as exc:
            raise _errno_of(exc) from None
        return self._new_entry(path)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        try:
            os.unlink(self._child(parent_inode, name))
        except OSError as exc:
            raise _errno_of(exc) from None

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        try:
            os.rmdir(self._child(parent_inode, name))
        except OSError as exc:
            raise _errno_of(exc) from None

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if flags != 0:
            # os.rename cannot pass RENAME_NOREPLACE/EXCHANGE on; refusing beats lying.
            raise FUSEError(errno.EINVAL)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        try:
            os.rename(old, new)
        except OSError as exc:
            raise _errno_of(exc) from None
        self._inodes.renamed(old, new)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        try:
            sv = os.statvfs(self._inodes.root)
        except OSError as exc:
            raise _errno_of(exc) from None
        out = pyfuse3.StatvfsData()
        out.f_bsize = sv.f_bsize
        out.f_frsize = sv.f_frsize
        out.f_blocks = sv.f_blocks
        out.f_bfree = sv.f_bfree
        out.f_bavail = sv.f_bavail
        out.f_files = sv.f_files
        out.f_ffree = sv.f_ffree
        out.f_favail = sv.f_favail
        out.f_namemax = sv.f_namemax
        return out


class XattrPassthrough(Passthrough):
    """The pass-through plus extended attributes, passed on to the source files.

    A subclass rather than a flag inside Passthrough, so the minimal one does not even
    have the methods and keeps pyfuse3's ENOSYS defaults.
    """

    def _xattr_target(self, ino: int) -> tuple[int | str, bool]:
        """What to hand os.*xattr, and whether symlinks may be followed.

        An open file's fd, as _stat_ino does: it may have no name any more, and the
        kernel's security.capability query before each write always has one open.
        """
        fds = self._inodes.open_fds.get(ino)
        if fds:
            # os.*xattr refuses follow_symlinks=False together with an fd.
            return next(iter(fds)), True
        # The kernel resolved any symlink itself; a name reaching us is the link.
        return self._inodes.path(ino), False

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        target, follow = self._xattr_target(inode)
        try:
            return os.getxattr(target, name, follow_symlinks=follow)
        except OSError as exc:
            raise _errno_of(exc) from None

    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        # pyfuse3 checks XATTR_CREATE/XATTR_REPLACE itself (through getxattr) and
        # passes no flags on, so plain set is right here.
        target, follow = self._xattr_target(inode)
        try:
            os.setxattr(target, name, value, follow_symlinks=follow)
        except OSError as exc:
            raise _errno_of(exc) from None

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        target, follow = self._xattr_target(inode)
        try:
            return [os.fsencode(n) for n in os.listxattr(target, follow_symlinks=follow)]
        except OSError as exc:
            raise _errno_of(exc) from None

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        target, follow = self._xattr_target(inode)
        try:
            os.removexattr(target, name, follow_symlinks=follow)
        except OSError as exc:
            raise _errno_of(exc) from None


async def _serve() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_terminate_on_signal)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rpmemfs.tools.bench.passthrough",
        description="Mount SRC at MNT through a minimal pass-through FUSE filesystem.",
    )
    parser.add_argument("source", metavar="SRC")
    parser.add_argument("mountpoint", metavar="MNT")
    parser.add_argument("--xattr", action="store_true",
                        help="pass extended attribute calls through to SRC (default: ENOSYS)")
    parser.add_argument("--debug", action="store_true", help="log every FUSE request")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)

    if not os.path.isdir(args.source):
        print(f"passthrough: {args.source}: not a directory", file=sys.stderr)
        return 2
    options = set(pyfuse3.default_options)  # carries default_permissions
    ops_class = XattrPassthrough if args.xattr else Passthrough
    options.add("fsname=passthrough-xattr" if args.xattr else "fsname=passthrough")
    pyfuse3.init(ops_class(args.source), args.mountpoint, options)
    try:
        trio.run(_serve)
    finally:
        # Unmounts whether the loop ended on a signal or an exception; a no-op
        # if someone already unmounted us.
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
