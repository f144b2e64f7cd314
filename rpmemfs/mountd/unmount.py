"""How a mount ends: `rpmemfs umount` and signals on the daemon's side (Ending), and taking a
mount out of the kernel's table without touching it (for the daemon and for the CLI), a dead
one left by a daemon that was killed too (clear_mountpoint, before the next mount there).

A FUSE daemon is not told when its mount is unmounted (the kernel sends DESTROY only for
fuseblk mounts); it sees its /dev/fuse end once the last user of the mount is gone, and only
then can it run its last durability point and close the pool. So `umount` cannot wait for
that by itself: `rpmemfs umount` (and the umount(8) helper, mount/umount.rpmemfs) asks the
daemon, which unmounts itself here, plainly (EBUSY while files are open: the mount stays),
and answers once more when the pool is closed. A signal detaches the mount lazily instead:
the mountpoint is gone at once, and files open there are served until they are closed.

The kernel may keep the mount alive after every file on it is closed: a copy of it in a mount
namespace made while it was mounted (a container, `ip netns exec`, a service's private /tmp)
where it is not unmounted with ours, or a process's working directory there. Nobody could
open a file on it but through those, so once it is detached and no file or directory is open
any more the daemon stops serving it (Ending.watch): what is left of it answers ENOTCONN.

Nothing here stats the mount itself: that would wait on the very daemon that is asking, or
hang on one that does not answer.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import stat
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import trio

from rpmemfs.mountd import control
from rpmemfs.mountd.errors import MountError
from rpmemfs.mountinfo import MountEntry, mount_at
from rpmemfs.units import count

log = logging.getLogger("rpmemfs.mount")

MNT_DETACH = 2  # umount2(2): detach now, let go of the filesystem when its last user does
FUSERMOUNT_SECONDS = 60.0
IDLE_POLL_SECONDS = 0.2  # how often a detached mount is checked for files still open

_libc = ctypes.CDLL(None, use_errno=True)


def kernel_path(path: str) -> str:
    """``path`` as the mount table writes a mountpoint: absolute, with its directories
    resolved. The last component is not resolved (that would stat the mount), unless no mount
    is found there and it is a symbolic link."""
    absolute = os.path.abspath(path)
    parent, name = os.path.split(absolute)
    point = os.path.join(os.path.realpath(parent), name) if name else absolute
    if mount_at(point) is None and os.path.islink(absolute):
        point = os.path.realpath(absolute)
    return point


def detach(point: str, source: str, *, lazy: bool) -> None:
    """Unmount the mount of ``source`` at ``point`` (lazily: even while files are open there).
    OSError when the kernel refuses (EBUSY: files are open), or when the mount on top at
    ``point`` is not that one (EINVAL): it is never someone else's that goes."""
    top = mount_at(point)
    if top is None:
        raise OSError(errno.EINVAL, "nothing is mounted there", point)
    if top.source != source:
        raise OSError(errno.EINVAL, f"{top.source} ({top.fstype}) is mounted over it", point)
    if os.geteuid() == 0:
        if _libc.umount2(os.fsencode(point), MNT_DETACH if lazy else 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), point)
        return
    # As a user, through the setuid helper that mounted it (libfuse does the same).
    done = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), point],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=FUSERMOUNT_SECONDS, check=False)
    if done.returncode != 0:
        text = (done.stderr or done.stdout).strip() or f"fusermount3 exited with {done.returncode}"
        code = errno.EBUSY if os.strerror(errno.EBUSY) in text else errno.EPERM
        raise OSError(code, text, point)


def connection_lost(point: str, timeout: float = 2.0) -> bool:
    """Whether the FUSE mount at ``point`` has lost its daemon (statfs says ENOTCONN). A
    statfs that does not answer within ``timeout`` (a daemon alive but stuck) is not a lost
    one. Not stat: the kernel answers it from its attribute cache for a while after the
    daemon died."""
    result: list[int] = []

    def probe() -> None:
        try:
            os.statvfs(point)
        except OSError as e:
            result.append(e.errno or 0)
        else:
            result.append(0)

    t = threading.Thread(target=probe, name="statfs-mount", daemon=True)
    t.start()
    t.join(timeout)
    return result == [errno.ENOTCONN]


def dead_mount(entry: MountEntry) -> str:
    """What a dead mount (its daemon killed, say) is, and what takes it away, for a message."""
    if entry.fstype == "fuse.rpmemfs":
        what, how = f"pool {entry.source.removeprefix('rpmemfs:')}", "rpmemfs umount"
    else:
        what, how = f"{entry.source} ({entry.fstype})", "umount"
    return (f"{entry.mountpoint} is a dead mount of {what} (its daemon has died): `{how} "
            f"{entry.mountpoint}` takes it away")


def not_durable(taken_over: str | None, log_at: str) -> str:
    """Why a mount's last durability point did not reach the replicas it needed, for
    `rpmemfs umount`: what the next mount of the pool does about it, and where the log is."""
    if taken_over is None:
        return ("the last durability point did not reach the replicas it needed (its log says "
                f"why: {log_at}); the next mount compares them in full")
    return ("this pool was fenced by a failover (a promote, or a mount with -o takeover, "
            f"elsewhere): {taken_over}; that pool is the primary now. What was written here "
            "since stays in this pool file alone, and the next mount of this pool with its "
            "replicas is refused (nothing is changed); to make it a replica of the new primary, "
            "or to fail back onto it, see docs/failover.md, \"The old primary comes back\" (its "
            f"log: {log_at})")


def clear_mountpoint(mountpoint: str, source: str) -> None:
    """Make sure a mount of ``source`` may go on ``mountpoint``: an existing directory with
    nothing mounted on it. A dead mount of the same source (its daemon was killed) is ours to
    take away, and is: the first mount after a crash needs no `rpmemfs umount` first. Anything
    else mounted there is a MountError naming it."""
    point = kernel_path(mountpoint)
    top = mount_at(point)
    if top is not None:
        if not connection_lost(point):
            raise MountError(f"{mountpoint} is already a mount point ({top.source}, {top.fstype})")
        if top.source != source or top.fstype != "fuse.rpmemfs":
            raise MountError(f"{dead_mount(top)}; mount there after that")
        try:
            # Lazily: files still open on it are answered ENOTCONN whatever is done.
            detach(point, source, lazy=True)
        except OSError as e:
            raise MountError(f"{dead_mount(top)}; it cannot be taken away here: "
                             f"{e.strerror or e}") from None
        log.warning("cleared the dead mount of this pool on %s (its daemon had died); the pool "
                    "was not closed clean: its log is replayed and its replicas compared in full",
                    mountpoint)
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as e:
        raise MountError(f"mountpoint {mountpoint}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    if mount_at(point) is not None:  # another one under the dead one
        raise MountError(f"{mountpoint} is already a mount point")


class Ending:
    """How one mount ends, on the daemon's side: `rpmemfs umount` over the control socket
    (:meth:`umount`, a control handler) and signals (:meth:`signals`). Both take the mount out
    of the kernel's table; the FUSE loop then ends when the last file open there is closed,
    and the daemon runs its last durability point, closes the pool and calls :meth:`tell`.
    """

    def __init__(self, mountpoint: str, pool: str) -> None:
        self.mountpoint = mountpoint
        # Resolved now, before mounting: afterwards resolving it would stat this very mount.
        self.point = os.path.realpath(mountpoint)
        self.source = "rpmemfs:" + pool
        self.detached = False  # the kernel let go of the mountpoint (open files still served)
        self._detached = trio.Event()
        self._held: list[int] = []  # `rpmemfs umount` connections, told when the pool is closed
        self._second = ""  # the signal that detached the mount: it stops serving if sent again
        self._lock = trio.Lock()

    async def _detach(self, *, lazy: bool, asker: control.Asker | None = None) -> None:
        async with self._lock:
            if asker is not None and not asker.present():
                # It timed out and told its user the mount stays: so it does.
                raise OSError(errno.ECANCELED, "the asker gave up waiting")
            if not self.detached:
                # In a thread: a plain unmount writes back cached pages, through this daemon.
                await trio.to_thread.run_sync(lambda: detach(self.point, self.source, lazy=lazy))
                self.detached = True
                self._detached.set()

    async def umount(self, args: list[str], send: control.Send) -> dict[str, Any]:
        """`rpmemfs umount MOUNTPOINT`: unmount (refused while files are open: the mount
        stays), and tell the asker when the pool is closed; its connection ends when this
        process does."""
        # Held before the unmount: the loop may end (and this task be cancelled) as soon as
        # the kernel lets go.
        held = send.hold()
        self._held.append(held)
        try:
            await self._detach(lazy=False, asker=send)
        except OSError as e:
            self._held.remove(held)
            os.close(held)
            if e.errno == errno.EBUSY:
                return {"error": f"{self.mountpoint} is busy: files are open on it (`fuser -vm "
                                 f"{self.mountpoint}` lists who has them); it stays mounted"}
            return {"error": f"cannot unmount {self.mountpoint}: {e.strerror or e}"}
        log.info("unmounted %s on request; closing the pool", self.mountpoint)
        return {"unmounting": True, "pid": os.getpid()}

    async def signals(self, terminate: Callable[[], None], reload: Callable[[], None] = lambda: None
                      ) -> None:
        """SIGTERM or SIGINT detaches the mount lazily: no new open reaches it, files open
        there keep working until closed, and the FUSE loop ends with the last of them (at
        once if none is open). A second one calls ``terminate`` (it ends the FUSE loop once
        the requests under way are answered, a durability point among them): files still open
        then get ENOTCONN. SIGHUP calls ``reload`` (the token file is read again), as daemons
        do and as systemd's ExecReload sends it."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            stopping = False
            async for sig in sigs:
                name = signal.Signals(sig).name
                if sig == signal.SIGHUP:
                    reload()
                    continue
                if not stopping:
                    stopping = True
                    try:
                        await self._detach(lazy=True)
                    except OSError as e:
                        log.error("signal %s: cannot detach %s (%s); stopping now", name,
                                  self.mountpoint, e)
                    else:
                        log.info("signal %s: %s detached", name, self.mountpoint)
                        self._second = name
                        continue
                else:
                    log.warning("signal %s again: stopping now; files still open on %s get "
                                "ENOTCONN", name, self.mountpoint)
                terminate()
                return

    async def watch(self, terminate: Callable[[], None], handles_open: Callable[[], int]) -> None:
        """Once detached, stop serving when no file or directory is open on the mount any more
        (``handles_open``), whatever else still holds it in the kernel (see the module's
        docstring). Usually the FUSE loop has ended before: the kernel let go at once."""
        await self._detached.wait()
        await trio.sleep(IDLE_POLL_SECONDS)  # time for the loop to end by itself
        if n := handles_open():
            log.warning("%s is detached; %s still open there are served until they are "
                        "closed%s", self.mountpoint, count(n, "file or directory", "files or directories"),
                        f" ({self._second} again stops now)" if self._second else "")
        while handles_open():
            await trio.sleep(IDLE_POLL_SECONDS)
        log.warning("%s is detached and nothing is open on it, but the kernel still holds it (a "
                    "copy in another mount namespace, or a working directory there): stopping",
                    self.mountpoint)
        terminate()

    def tell(self, last: dict[str, Any]) -> None:
        """The pool is closed (``last`` says how): the last word to every `rpmemfs umount`."""
        control.tell_held(self._held, last)
