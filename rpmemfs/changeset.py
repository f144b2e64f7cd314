"""The contract between the filesystem and durability: what one durability point makes
durable, where it comes from and how it is persisted locally.

The filesystem (``rpmemfs.fs``) produces :class:`Changes` and satisfies :class:`ChangeSource`;
durability (``rpmemfs.durability``) takes them, persists them through a :class:`Persister`
(``rpmemfs.pmem.PoolMapping`` satisfies it) and ships them to the replicas. Neither imports
the other: both import this module, which sits beneath both, so the contract is written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from rpmemfs.ranges import Ranges


@dataclass(slots=True)
class Changes:
    """What changed since the last durability point, handed over by ``take_changes()``."""

    persisted: Ranges  # persisted outside a point (checkpoints), in order: replicas need them
    stored: Ranges  # written with non-temporal stores: durable here already
    data: Ranges  # written through the cache: flushed before the log record is stored
    log: tuple[int, bytes] | None  # the staged log record (offset, bytes), to store last
    seq: int  # last log record covered
    tail: int  # log position after it
    # With a log record: the position stamp that says the point ended (offset, bytes), to
    # store once the record is persistent (rpmemfs.fs.log.scan reads it after a crash).
    stamp: tuple[int, bytes] | None = None


class ChangeSource(Protocol):
    """The filesystem as a durability point sees it."""

    def has_changes(self) -> bool: ...
    def take_changes(self) -> Changes: ...
    def mark_durable(self, seq: int, tail: int) -> None: ...


class Persister(Protocol):
    """Local persistence. The filesystem persists through it what it writes outside a point
    (a repaired header, a checkpoint); a point stores its log record through it after the data
    (no durable record ever points at data that is not durable)."""

    def persist(self, ranges: Iterable[tuple[int, int]]) -> None: ...
    def persist_then_store(self, first: Iterable[tuple[int, int]], offset: int, data: bytes,
                           then: tuple[int, bytes] | None = None) -> None: ...
