"""POSIX calls from the kernel (pyfuse3) turned into filesystem calls, and errors into errnos.

Errno choices worth knowing: a full pool gives ENOSPC (data blocks or the metadata log);
names over 255 bytes ENAMETOOLONG; a durability point that cannot complete gives EIO, as a
disk would.

Permissions and POSIX ACLs are checked by the kernel (default_permissions; FUSE_POSIX_ACL
when the mount has xattrs: the kernel reads system.posix_acl_access through getxattr). What
ext4 does beside the check is ours: ACLs and modes kept in step, default ACLs and setgid
directories inherited, and the umask (FUSE_DONT_MASK: the kernel leaves it to us, as it
must not apply under a default ACL). Setuid and setgid are cleared on write, truncate and
chown by us when the kernel says so (FUSE_HANDLE_KILLPRIV_V2, negotiated by the patched
binding: the kernel checks CAP_FSETID and flags the request, we apply the rest of
should_remove_suid); with it the kernel also stops asking for security.capability before
every write. It flags the chown of every non-directory, FIFOs, devices and sockets too,
and clears nothing of theirs itself.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3

from rpmemfs.callers import ProcCaller
from rpmemfs.durability import Durability, DurabilityError
from rpmemfs.durability.grouped import GroupedPoints
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.extents import Extents
from rpmemfs.fs.filesystem import Filesystem, NeedSync
from rpmemfs.fs.inode import Inode
from rpmemfs.poller import RequestPoller
from rpmemfs.pool.layout import BLOCK

log = logging.getLogger("rpmemfs.fuse")

STATUS_XATTR = b"user.rpmemfs.status"
# File capabilities are not supported (as on a nosuid mount): the name is never stored, and
# the patched pyfuse3 answers ENODATA for it without a coroutine (see absent_xattrs). The
# kernel asks for it before a write to a setuid/setgid file, and before every write where
# FUSE_HANDLE_KILLPRIV_V2 is not negotiated (kernels before 5.11).
CAPABILITY_XATTR = b"security.capability"
TIMEOUT = 1.0  # entry/attr cache seconds: every change goes through this daemon anyway

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def errno_of(e: BaseException, where: str) -> int:
    """The errno a FUSE request gets for ``e``; anything unexpected is EIO, logged."""
    if isinstance(e, FsError):
        return e.errno or errno.EIO
    if isinstance(e, DurabilityError):
        # A durability point that could not complete: what a failing disk answers.
        return errno.EIO
    if isinstance(e, pyfuse3.FUSEError):
        return int(e.errno)
    log.error("internal error in %s", where, exc_info=e)
    return errno.EIO


def errors(fn: F) -> F:
    """Turn filesystem errors into FUSE replies (errno_of). Every request through here also
    restarts the daemon's polling budget."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        args[0].poller.kick()
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:
            raise pyfuse3.FUSEError(errno_of(e, fn.__name__)) from None

    return wrapper  # type: ignore[return-value]


class Operations(pyfuse3.Operations):
    enable_writeback_cache = False
    supports_dot_lookup = True
    enable_dont_mask = True
    enable_handle_killpriv = False
    # The kernel then asks for no security.capability before each write (one request more
    # per write) and tells us when a write, truncate or chown must clear setuid/setgid.
    enable_handle_killpriv_v2 = True
    # Read /dev/fuse before waiting on it (the patched binding): with several programs
    # calling at once a request is nearly always queued already, and learning that through
    # epoll cost more than the write itself (4 and 16 concurrent writers, no replicas:
    # 2.2x the IOPS, under half the daemon's CPU time per write + fsync).
    read_first = True

    def __init__(self, fs: Filesystem, durability: Durability, describe: Callable[[], dict[str, Any]],
                 xattrs: bool = True, poll_us: int = 0, writeback_cache: bool = False) -> None:
        super().__init__()
        self.poller = RequestPoller(poll_us)
        self.fs = fs
        self._point = durability.point
        self._point_now = durability.point_now
        # fsyncs that wait for replicas are answered by this group commit (fsync_now).
        self.fsyncs: GroupedPoints[pyfuse3.Later] = GroupedPoints(durability, self._answer_fsync,
                                                                  self.poller.held)
        self.enable_writeback_cache = writeback_cache
        # Without xattrs, ENOSYS makes the kernel stop asking for security.capability
        # at all; with them, the binding answers that question itself when it comes.
        self.xattrs = xattrs
        self.absent_xattrs = frozenset({CAPABILITY_XATTR}) if xattrs else frozenset()
        self.getxattr_calls = 0  # that reached this daemon's Python code, for status
        # ACLs live in xattrs: without them setfacl gets EOPNOTSUPP (from our ENOSYS).
        self.enable_acl = xattrs
        fs.posix_acl = xattrs
        self.describe = describe
        self._dirs: dict[int, list[tuple[bytes, int]]] = {}
        self._next_dh = 1

    def counters(self) -> dict[str, Any]:
        """What this layer counts, for status."""
        return {
            "copy_file_range": self.extents.stats(),
            "poll_us": self.poller.budget_us,
            "poll_passes": self.poller.polls,
            "poll_yielded": self.poller.yielded,
            "getxattr_calls": self.getxattr_calls,
            # fsyncs answered by a group's point (durability/grouped.py), and those points
            "fsync_grouped": {"fsyncs": self.fsyncs.asked, "points": self.fsyncs.groups},
            # Whether the kernel took FUSE_HANDLE_KILLPRIV_V2 (no GETXATTR before writes).
            "handle_killpriv_v2": pyfuse3.handle_killpriv_v2(),
        }

    # ---------------------------------------------------------------- helpers

    def entry(self, node: Inode) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.ino
        e.generation = 0
        e.entry_timeout = TIMEOUT
        e.attr_timeout = TIMEOUT
        e.st_mode = node.mode
        e.st_nlink = node.nlink
        e.st_uid = node.uid
        e.st_gid = node.gid
        e.st_rdev = node.rdev
        e.st_size = BLOCK if node.children is not None else node.size
        e.st_blksize = BLOCK
        e.st_blocks = len(node.blocks) * (BLOCK // 512)
        e.st_atime_ns = node.atime
        e.st_mtime_ns = node.mtime
        e.st_ctime_ns = node.ctime
        return e

    @staticmethod
    def caller(ctx: pyfuse3.RequestContext) -> ProcCaller:
        return ProcCaller(ctx.uid, ctx.gid, ctx.pid)

    def looked_up(self, node: Inode) -> pyfuse3.EntryAttributes:
        node.lookups += 1
        return self.entry(node)

    # ---------------------------------------------------------------- namespace

    @errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        return self.looked_up(self.fs.lookup(parent_inode, name))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            try:
                self.fs.forget(ino, n)
            except Exception:
                log.exception("forget of inode %d", ino)

    @errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entry(self.fs.node(inode))

    @errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self._retry(lambda: self.fs.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime=attr.st_atime_ns if fields.update_atime else None,
            mtime=attr.st_mtime_ns if fields.update_mtime else None,
            atime_now=fields.update_atime_now,
            mtime_now=fields.update_mtime_now,
            kill_suidgid=self.caller(ctx) if ctx.kill_suidgid else None,
        ))
        return self.entry(node)

    @errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.fs.node(inode)
        if not stat.S_ISLNK(node.mode):
            raise FsError(errno.EINVAL)
        return node.target

    @errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.looked_up(self.fs.create(parent_inode, name, mode, ctx.uid, ctx.gid, rdev,
                                             umask=ctx.umask, caller=self.caller(ctx)))

    @errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
                    ) -> pyfuse3.EntryAttributes:
        return self.looked_up(self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid,
                                            umask=ctx.umask, caller=self.caller(ctx)))

    @errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.unlink(parent_inode, name)

    @errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.rmdir(parent_inode, name)

    @errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.looked_up(self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.looked_up(self.fs.link(inode, new_parent_inode, new_name))

    # ---------------------------------------------------------------- files

    @errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.fs.node(inode)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if flags & os.O_TRUNC:
            # libfuse negotiates atomic O_TRUNC: the kernel sends no separate setattr.
            caller = self.caller(ctx)
            await self._retry(lambda: self.fs.open_truncate(inode, caller))
        self.fs.opened(inode)
        # keep_cache only while nothing truncated the file behind the kernel's page cache
        return pyfuse3.FileInfo(fh=inode, keep_cache=not flags & os.O_TRUNC)

    @errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        node = self.fs.create(parent_inode, name, mode, ctx.uid, ctx.gid, umask=ctx.umask,
                              caller=self.caller(ctx))
        self.fs.opened(node.ino)
        return pyfuse3.FileInfo(fh=node.ino, keep_cache=True), self.looked_up(node)

    @errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return self.fs.read(fh, off, size)

    @errors
    async def write(self, fh: int, off: int, buf: bytes,
                    kill_suidgid: pyfuse3.RequestContext | None = None) -> int:
        if kill_suidgid is not None:
            # A writer without CAP_FSETID (FUSE_WRITE_KILL_SUIDGID): the kernel leaves
            # clearing setuid/setgid to us (HANDLE_KILLPRIV_V2), before the data lands.
            self.fs.kill_suidgid(self.fs.node(fh), self.caller(kill_suidgid))
        try:
            return self.fs.write(fh, off, buf)
        except NeedSync:
            # Blocks freed by earlier changes become reusable once those changes are durable.
            await self.durable()
            return self.fs.write(fh, off, buf)

    def write_now(self, fh: int, off: int, buf: bytes) -> int | None:
        """write() answered by the binding without a coroutine (the patched pyfuse3 calls it
        first, for writes that clear no setuid/setgid); None: it must wait for a point, and
        write() does it."""
        self.poller.kick()
        try:
            return self.fs.write(fh, off, buf)
        except NeedSync:
            return None
        except Exception as e:
            raise pyfuse3.FUSEError(errno_of(e, "write")) from None

    async def _retry(self, call: Callable[[], Inode]) -> Inode:
        try:
            return call()
        except NeedSync:
            await self.durable()
            return call()

    # fallocate, SEEK_DATA/SEEK_HOLE and copy_file_range, errnos included: rpmemfs.fs.extents
    # (the filesystem's ``extents``) and README's "POSIX semantics".
    @property
    def extents(self) -> Extents:
        return self.fs.extents

    @errors
    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        # Never ENOSYS: the kernel would stop asking, for every mode (rpmemfs.fs.extents).
        await self._retry(lambda: self.extents.fallocate(fh, mode, offset, length))

    @errors
    async def lseek(self, fh: int, offset: int, whence: int) -> int:
        return self.extents.seek(fh, offset, whence)

    @errors
    async def copy_file_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int,
                              length: int, flags: int) -> int:
        try:
            return self.extents.copy(fh_in, off_in, fh_out, off_out, length, flags)
        except NeedSync:
            await self.durable()
            return self.extents.copy(fh_in, off_in, fh_out, off_out, length, flags)

    async def flush(self, fh: int) -> None:
        # close(2) is not a durability point in POSIX; fsync is.
        return None

    @errors
    async def release(self, fh: int) -> None:
        self.fs.released(fh)

    async def durable(self) -> None:
        """A durability point, with no polling of /dev/fuse while it waits (poller.py says why)."""
        with self.poller.held():
            await self._point()

    @errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.durable()

    def fsync_now(self, fh: int, datasync: bool, later: pyfuse3.Later) -> Any:
        """fsync() answered by the binding without a coroutine: 0 when the point is done
        already (no replicas; async replication with room), None when ``later`` is answered
        once its group's point ended (durability/grouped.py), NotImplemented when fsync()
        serves it after all. A point that fails gives EIO, as a failing disk would."""
        try:
            if self._point_now():
                self.poller.kick()
                return 0
        except Exception as e:
            self.poller.kick()
            return errno_of(e, "fsync")
        if not self.fsyncs.offer(later):
            return NotImplemented  # one program alone: fsync() posts its point at once
        return None

    @staticmethod
    def _answer_fsync(later: pyfuse3.Later, error: BaseException | None) -> None:
        # Whatever failed the point was logged where it failed; to the caller it is EIO.
        pyfuse3.reply_later(later, 0 if error is None else errno.EIO)

    # ---------------------------------------------------------------- directories

    @errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self.fs.readdir(inode)  # ENOTDIR / ENOENT now rather than at readdir
        dh = self._next_dh
        self._next_dh += 1
        self._dirs[dh] = [(b"", inode)]  # placeholder: the listing is taken at offset 0
        return dh

    @errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        listing = self._dirs.get(fh)
        if listing is None:
            raise FsError(errno.EBADF)
        if start_id == 0:
            # A fresh listing at offset 0 (also after rewinddir); later chunks page through it.
            ino = listing[0][1] if listing and listing[0][0] == b"" else None
            if ino is not None:
                listing = [(b"", ino), *self.fs.readdir(ino)]
                self._dirs[fh] = listing
        for i in range(start_id + 1, len(listing)):
            name, child = listing[i]
            node = self.fs.inodes.get(child)
            if node is None:
                continue
            if not pyfuse3.readdir_reply(token, name, self.entry(node), i):
                return
            node.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    def handles_open(self) -> int:
        """Files and directories open on the mount now: a mount detached while in use is
        served until none is left (rpmemfs/mountd/unmount.py)."""
        return len(self._dirs) + self.fs.open_files

    @errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.durable()

    @errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = self.fs.statfs()
        d = pyfuse3.StatvfsData()
        d.f_bsize = d.f_frsize = s["bsize"]
        d.f_blocks = s["blocks"]
        d.f_bfree = d.f_bavail = s["bfree"]
        d.f_files = s["files"]
        d.f_ffree = d.f_favail = s["ffree"]
        d.f_namemax = s["namemax"]
        return d

    # ---------------------------------------------------------------- xattrs

    @errors
    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        if not self.xattrs:
            raise FsError(errno.ENOSYS)
        if name == STATUS_XATTR:
            raise FsError(errno.EPERM)
        if name == CAPABILITY_XATTR:
            raise FsError(errno.EOPNOTSUPP)  # file capabilities are not supported (see above)
        def set_it() -> Inode:
            self.fs.setxattr(inode, name, value, self.caller(ctx))
            return self.fs.node(inode)

        await self._retry(set_it)

    @errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        self.getxattr_calls += 1
        if not self.xattrs:
            raise FsError(errno.ENOSYS)
        if name == STATUS_XATTR and inode == pyfuse3.ROOT_INODE:
            # also reachable without the control socket, e.g. from inside a container
            return json.dumps(self.describe()).encode()
        value = self.fs.getxattr(inode, name)
        if value is None:
            # Not through FsError: building and mapping an OSError costs most of this
            # call, and ENODATA is its common answer.
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value

    @errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if not self.xattrs:
            raise FsError(errno.ENOSYS)
        return list(self.fs.node(inode).xattrs)

    @errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if not self.xattrs:
            raise FsError(errno.ENOSYS)
        self.fs.removexattr(inode, name)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        # default_permissions makes the kernel check modes (and ACLs) itself.
        return True
