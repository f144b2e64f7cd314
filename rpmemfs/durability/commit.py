"""The periodic commit (`-o commit=SECONDS`, default 5, 0 = off, as ext4's commit=): changes
that nobody made durable become durable, locally and on the replicas, within that interval.

Without it, data written without fsync reached the replicas only with some later fsync or at
unmount, and the log record describing it stayed in this process's memory: a crash of the
mount (kill -9, the node dying) lost all of it since the last fsync, however long ago.
`sync -f` cannot help: Linux forwards syncfs(2) to a FUSE daemon only when the connection has
``fc->sync_fs`` set, and only virtiofs sets it (fs/fuse/inode.c ``fuse_sync_fs`` returns 0
without it; fs/fuse/virtio_fs.c ``virtio_fs_get_tree`` sets it), so for this daemon syncfs is
a no-op. `rpmemfs flush MOUNTPOINT` asks for a point at once instead (mountd/daemon.py).

Each tick costs nothing when nothing changed (:meth:`Durability.pending`); otherwise it runs an
ordinary :meth:`Durability.point`, which pipelines safely with fsyncs and keeps log order, so
the commit needs no ordering of its own. A failing commit (too few replicas, say) is logged
once when the episode begins and once when it ends, never every tick, and never ends the
daemon: the changes stay durable locally, and the next tick tries again.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from rpmemfs.durability.point import Durability, DurabilityError

log = logging.getLogger("rpmemfs.durability.commit")

DEFAULT_COMMIT = 5.0  # seconds
MAX_COMMIT = 24 * 3600.0


class Committer:
    """Runs a durability point every ``seconds`` when something changed meanwhile."""

    def __init__(self, durability: Durability, seconds: float) -> None:
        if not 0 < seconds <= MAX_COMMIT:
            raise ValueError(f"commit interval {seconds!r}: must be above 0 and at most {MAX_COMMIT:g} s")
        self.durability = durability
        self.seconds = seconds
        self.points = 0  # commits that ran a point and succeeded
        self.failures = 0
        self.failing: str | None = None  # the error of the episode under way

    async def run(self) -> None:
        """Tick until cancelled (the mount ends; its final point follows)."""
        while True:
            await trio.sleep(self.seconds)
            await self.tick()

    async def tick(self) -> bool:
        """One commit if something is pending; False when it failed."""
        if not self.durability.pending():
            return True
        try:
            # Shielded: a point cancelled in flight would fail its replicas for nothing (the
            # mount is ending and its final point follows); it is bounded by replica_timeout.
            with trio.CancelScope(shield=True):
                await self.durability.flush(background=True)
        except DurabilityError as exc:
            self._failed(str(exc), exc.unexpected)
            return False
        except Exception as exc:  # a bug must not end the daemon, nor go unseen
            self._failed(f"{type(exc).__name__}: {exc}", exc)
            return False
        self.points += 1
        if self.failing is not None:
            log.warning("periodic commit works again (it failed %d times: %s)", self.failures,
                        self.failing)
            self.failing = None
            self.failures = 0
        return True

    def _failed(self, why: str, unexpected: BaseException | None) -> None:
        self.failures += 1
        if self.failing is None:
            self.failing = why
            log.error("periodic commit failed: %s; changes since the last durable point are "
                      "durable locally only, tried again every %g s (logged again once it works)",
                      why, self.seconds, exc_info=unexpected)
        else:
            log.debug("periodic commit failed again: %s", why)

    def status(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "points": self.points, "failing": self.failing}
