"""Durability: every durability point of a mounted pool, from start to end.

A point (fsync, fdatasync, fsyncdir, a full pool waiting for freed blocks, unmount) takes the
filesystem's changes, makes them durable locally (data, fence, then the log record that points
at it) and, when the pool has replicas, posts them to every in-sync replica and waits for the
acknowledgements the policy requires. Points are pipelined and end in log order; the ranges of
a point that failed are sent again with the next one. `point.py` holds all of it;
`backlog.py` is asynchronous replication's queue and its senders (`-o replication=async`);
`commit.py` runs points periodically for changes nobody fsynced (`-o commit=SECONDS`);
`grouped.py` runs one point for a group of callers answered later (the FUSE fsyncs).
"""

from rpmemfs.changeset import Changes, ChangeSource, Persister
from rpmemfs.durability.backlog import DEFAULT_MAX_LAG, Backlog
from rpmemfs.durability.commit import DEFAULT_COMMIT, Committer
from rpmemfs.durability.point import Durability, DurabilityError
from rpmemfs.durability.stale_table import StaleTable
from rpmemfs.durability.stats import Stats

__all__ = ["DEFAULT_COMMIT", "DEFAULT_MAX_LAG", "Backlog", "ChangeSource", "Changes", "Committer",
           "Durability", "DurabilityError", "Persister", "StaleTable", "Stats"]
