"""The bench waits for the machine to go quiet before measuring (rpmemfs/tools/bench/settle.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rpmemfs.tools.bench.settle import idle_fraction, wait_until_quiet

BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def busy(seconds: float, cpus: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY.format(s=seconds)]) for _ in range(cpus)]


def test_a_busy_cpu_is_not_idle() -> None:
    procs = busy(1.0, os.cpu_count() or 1)
    try:
        time.sleep(0.1)
        assert idle_fraction(0.3) < 0.5
    finally:
        for p in procs:
            p.wait()


@pytest.mark.timeout(30)
def test_the_wait_ends_when_the_load_does_and_gives_up_at_its_timeout() -> None:
    if wait_until_quiet(timeout=5) is None:
        # Another job keeps the machine busy: the end of this test's own load cannot be seen.
        pytest.skip("the machine is busy with something else")
    procs = busy(1.2, os.cpu_count() or 1)
    try:
        time.sleep(0.1)
        assert wait_until_quiet(timeout=0.5) is None  # still busy: gave up
        waited = wait_until_quiet(timeout=10)
        assert waited is not None and waited >= 0.3  # waited for the rest of the load
    finally:
        for p in procs:
            p.wait()
