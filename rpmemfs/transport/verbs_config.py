"""What the verbs transport needs from this node before pyverbs is imported: which RDMA devices
the kernel shows, and how the transport is to run (:class:`VerbsSettings`).

It sits beneath both the transport chooser (choose.py) and the verbs transport (verbs.py,
rdma.py), so that neither has to import the other to learn these. The environment is read
only by :meth:`VerbsSettings.from_env`, called where a transport is built; nothing reads it
at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def rdma_devices() -> list[str]:
    """The RDMA devices the kernel shows, read without loading pyverbs."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


@dataclass(frozen=True, slots=True)
class VerbsSettings:
    """How one verbs transport runs, fixed when it is built."""

    # The local address queue pairs leave from, which picks the device; None: where the
    # routing table says.
    src: str | None = None
    # Busy-poll the completion queue this long before sleeping on the channel: a wake-up from
    # epoll costs more than most barriers (see docs/verbs.md for the measurements).
    spin_us: int = 1000
    # False keeps the 8-byte READ as the appliance flush even where native FLUSH is available,
    # and lanes plain queue pairs (on rxe under emulation a FLUSH-ended barrier measured 0.73x
    # of a READ-ended one).
    native_flush: bool = True

    @classmethod
    def from_env(cls, src: str | None = None, env: Mapping[str, str] | None = None) -> VerbsSettings:
        """The settings $RPMEMFS_RDMA_SRC, $RPMEMFS_VERBS_SPIN_US and $RPMEMFS_VERBS_FLUSH
        ("read": no native FLUSH) ask for; ``src``, when given, wins over the first."""
        env = os.environ if env is None else env
        return cls(
            src=src or env.get("RPMEMFS_RDMA_SRC") or None,
            spin_us=int(env.get("RPMEMFS_VERBS_SPIN_US", "1000")),
            native_flush=env.get("RPMEMFS_VERBS_FLUSH", "native") != "read",
        )
