"""The pool's format, beneath both the filesystem and replication.

A pool is one file of persistent memory: two copies of its header, two log areas, the sync map
and the data blocks (layout.py), read and written through header.py; the epoch that fences a
replica set (layout.py's epoch helpers) and the sync map that says what each replica misses
(syncmap.py). The filesystem owns what the log and the data blocks mean; replication owns copies
of byte ranges. Both need this package and neither needs the other.
"""
