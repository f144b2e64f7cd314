"""A pool as a whole file or device: where a new one is written (place.py: a file made for it,
or a device DAX) and growing one (grow.py).

Both map the pool (pmem.py) and write its format (pool/), so they sit above the two: the
mapping reads the pool's header to learn how long a pool on a device is, and the format
itself needs neither.
"""
