"""Who owns each pool on this target: the epoch of its current writer, recorded on disk.

Fencing rests on this record. An initiator that opens a pool to write it claims it under an
epoch; the target writes the claim here (atomically, and durably, before it answers) and from
then on refuses any writer whose claim is older, naming the owner: so an old primary that
comes back after a failover is refused even before the new primary has written anything.

The record also says when a resync of the pool began and has not ended: while an initiator
sends a replica what it missed, the replica holds parts of two points in time, and a copy of it
is no pool to promote. The initiator records the resync here before its first write and clears
it once the replica is in sync, so a resync cut short (the initiator killed) stays visible to
whoever would promote or recover from this replica; a later claim keeps it until a resync ends.

The record lives beside the pool, in ``.NAME.owner`` (JSON), not in the pool: the pool's
bytes are the primary's to write, header included, and a primary must not be able to
overwrite the record that fences it. Pool names never start with a dot, so the record is
outside the pool namespace. A pool without a record (made before records existed) is owned
by the epoch in its header.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rpmemfs.pool.layout import epoch_gen, show_epoch
from rpmemfs.poolname import PoolNameError, check_name
from rpmemfs.printable import printable
from rpmemfs.target.pooldir import PoolDir

log = logging.getLogger("rpmemfs.target.owners")

# What an initiator may say about itself; the target repeats it to whoever it refuses, to its
# log and to `rpmemfs pools`: stored escaped (printable) and cut to MAX_HOLDER_TEXT characters.
HOLDER_FIELDS = {"host": str, "pid": int, "pool": str, "mountpoint": str, "command": str}
MAX_HOLDER_TEXT = 256
# The largest record those bounds allow: five strings (four holder fields and the resync's
# "by") of MAX_HOLDER_TEXT characters, each at most 12 bytes in JSON (a character outside the
# BMP is a surrogate pair of \uXXXX escapes), is 15 KiB. A record cut short when read would
# be unreadable, and the pool's header (the writer's own bytes) would fence in its place.
MAX_RECORD = 64 << 10


@dataclass(frozen=True)
class Owner:
    epoch: int
    holder: dict[str, Any] = field(default_factory=dict)
    since: float = 0.0  # when this epoch claimed the pool here (seconds since the epoch)
    # A resync under way, or cut short: {"since": seconds since the epoch, "by": who began it}.
    resync: dict[str, Any] | None = None

    def describe(self) -> str:
        h = self.holder
        who = h.get("host") or "an unnamed initiator"
        parts = [f"pid {h['pid']}"] if "pid" in h else []
        if "pool" in h:
            parts.append(f"pool {h['pool']}")
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since)) if self.since else "?"
        extra = f" ({', '.join(parts)})" if parts else ""
        return f"{who}{extra} at epoch {show_epoch(self.epoch)} since {when}"

    def resync_text(self) -> str | None:
        """What a resync that has not ended says to whoever would copy this replica."""
        if self.resync is None:
            return None
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.resync.get("since", 0)))
        return f"a resync by {self.resync.get('by') or 'an unnamed initiator'} began {when} and did not end"

    def as_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "epoch_shown": show_epoch(self.epoch), "holder": self.holder,
                "since": self.since, "described": self.describe(), "resync": self.resync,
                "resync_described": self.resync_text()}


def clean_holder(value: object) -> dict[str, Any]:
    """The holder fields an initiator sent, checked (unknown fields and bad types dropped, text
    escaped and bounded); records written before text was escaped are cleaned as they are read."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {}
    for key, kind in HOLDER_FIELDS.items():
        v = value.get(key)
        if isinstance(v, kind) and not isinstance(v, bool):
            out[key] = printable(v)[:MAX_HOLDER_TEXT] if isinstance(v, str) else v
    return out


def _resync(value: object) -> dict[str, Any] | None:
    """A recorded resync marker, checked; an unreadable one still marks the pool (it was set)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return {"since": 0.0, "by": "unknown (the record's marker is unreadable)"}
    since = value.get("since")
    by = value.get("by")
    return {"since": float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else 0.0,
            "by": printable(by)[:MAX_HOLDER_TEXT] if isinstance(by, str) else ""}


def refusal(owner: Owner | None, prev: int, cur: int, takeover: bool) -> str | None:
    """Why an initiator claiming the pool at ``cur`` (it was at ``prev`` before this mount)
    must not write it, or None.

    Epochs on a target only rise: a claim at the recorded epoch itself (a reconnect within one
    mount) keeps it; any other must be above it. ``prev`` is the claimant's word: were it
    enough, a client holding a token could claim with ``prev`` = the record at a lower epoch
    (or the fenced primary's own), and the primary a failover fenced would be let in again.

    A normal claim rises a generation (a mount claims at the generation after the one its
    pool was at): it is let in when the pool is where this initiator left it (``prev``) or
    behind by a generation or more (a replica that missed this initiator's earlier mounts:
    resync brings it up to date), and ``cur`` is of a later generation than the record.
    Anything else was claimed by another initiator since (a failover), or would not rise:
    refused.

    A takeover (promote, mount --takeover) is let in only with an epoch above the recorded
    one. Epochs compare as integers (generation, then nonce), so of two takeovers racing with
    the same generation exactly one wins on every target, whatever the order they arrive in.
    """
    if owner is None:
        return None
    recorded = owner.epoch
    if takeover:
        if cur > recorded:
            return None
        return (f"it is held by {owner.describe()}, which is not older than this takeover's "
                f"epoch {show_epoch(cur)}; another takeover won")
    if cur == recorded:
        return None
    if recorded != prev and epoch_gen(recorded) >= epoch_gen(prev):
        # The epoch it claims under (a running mount's own, as its status shows), not ``prev``.
        return (f"it is held by {owner.describe()}, but this initiator claims it at epoch "
                f"{show_epoch(cur)}: the pool was taken over since (a failover) and has moved on; "
                "refusing to let an older owner write it (see docs/failover.md)")
    if epoch_gen(cur) <= epoch_gen(recorded):
        return (f"it is held by {owner.describe()}, and this claim's epoch {show_epoch(cur)} is not "
                "of a later generation: epochs on a target only rise, and a claim that does not "
                "rise is not let in (see docs/failover.md)")
    return None


class OwnerBook:
    """The owner records of one pool directory."""

    def __init__(self, pool_dir: PoolDir) -> None:
        self.dir = pool_dir
        self._cache: dict[str, Owner | None] = {}

    def _record(self, name: str) -> str:
        return f".{check_name(name)}.owner"

    def get(self, name: str) -> Owner | None:
        if name in self._cache:
            return self._cache[name]
        owner = self._read(name)
        self._cache[name] = owner
        return owner

    def _read(self, name: str) -> Owner | None:
        path = self._record(name)
        try:
            raw = self.dir.read_record(path, MAX_RECORD, "owner record")
        except PoolNameError as exc:
            if not os.path.lexists(os.path.join(self.dir.path, path)):
                return None
            # Not a file of ours: the header's epoch fences, as for an unreadable record.
            log.error("owner record of pool %s is refused (%s); falling back to the pool header's epoch",
                      name, exc)
            return None
        try:
            doc = json.loads(raw)
            epoch = doc["epoch"]
            if not isinstance(epoch, int) or not 0 <= epoch < 1 << 64:
                raise ValueError(f"epoch {epoch!r}")
            since = doc.get("since", 0.0)
            return Owner(epoch, clean_holder(doc.get("holder")), float(since), _resync(doc.get("resync")))
        except (ValueError, KeyError, TypeError) as exc:
            # Refusing every writer would make the pool unusable; the header's epoch still
            # fences (the caller falls back to it), and the operator is told.
            log.error("owner record %s is unreadable (%s); falling back to the pool header's epoch",
                      os.path.join(self.dir.path, path), exc)
            return None

    def set(self, name: str, owner: Owner) -> None:
        """Record ``owner`` durably before returning (write, fsync, rename, fsync the dir); its
        text checked and bounded here, whoever built it, so that the record reads back whole."""
        owner = replace(owner, holder=clean_holder(owner.holder), resync=_resync(owner.resync))
        self.dir.write_record(self._record(name), json.dumps(
            {"epoch": owner.epoch, "holder": owner.holder, "since": owner.since,
             "resync": owner.resync}).encode())
        self._cache[name] = owner

    def forget(self, name: str) -> None:
        """The pool was removed: so is its record."""
        self._cache.pop(name, None)
        self.dir.unlink(self._record(name), missing_ok=True)
