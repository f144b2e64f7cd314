"""The failover test's writer: `python writer.py MNT FIRST` writes record FIRST, FIRST+1, ...
into MNT/records (a fixed 64-byte slot each: pwrite at its index times 64), fsyncs after each,
and prints "INDEX MONOTONIC" on stdout once the fsync returned: those are the acknowledged
records, which the test logs outside the cluster. It waits up to 60 s for the mount to appear
and exits at the first error, printing "E ERRNO".

`python writer.py --check MNT ACKED` prints how many of the records listed in the file ACKED
(one index a line) are missing or wrong in MNT/records, then the first few of them.
"""

from __future__ import annotations

import os
import sys
import time

SLOT = 64


def record(i: int) -> bytes:
    return f"record {i:010d} ".encode().ljust(SLOT - 1, b"x") + b"\n"


def write(mnt: str, first: int) -> int:
    path = os.path.join(mnt, "records")
    deadline = time.monotonic() + 60
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                print(f"E {e.errno}", flush=True)
                return 1
            time.sleep(0.05)
    i = first
    while True:
        try:
            os.pwrite(fd, record(i), i * SLOT)
            os.fsync(fd)
        except OSError as e:
            print(f"E {e.errno}", flush=True)
            return 1
        print(f"{i} {time.monotonic():.6f}", flush=True)
        i += 1


def check(mnt: str, acked_file: str) -> int:
    with open(acked_file) as f:
        acked = [int(line) for line in f if line.strip()]
    with open(os.path.join(mnt, "records"), "rb") as f:
        data = f.read()
    bad = [i for i in acked if data[i * SLOT:(i + 1) * SLOT] != record(i)]
    print(len(bad), *bad[:10])
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2], sys.argv[3]))
    sys.exit(write(sys.argv[1], int(sys.argv[2])))
