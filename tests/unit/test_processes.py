"""The test harness's daemon processes (rpmemfs/tools/processes.py): reading a daemon's log
while it writes."""

from __future__ import annotations

import sys
from pathlib import Path

from rpmemfs.tools.processes import READY_PREFIX, TargetProcess

# A stand-in daemon: one line on stderr, its listening line, then stderr lines as fast as it can.
CHATTY = f"""
import sys, time
sys.stderr.write("first line, intact\\n")
sys.stderr.flush()
print({READY_PREFIX!r} + "127.0.0.1:9", flush=True)
end = time.monotonic() + 2.0
i = 0
while time.monotonic() < end:
    sys.stderr.write(f"line {{i}}\\n")
    sys.stderr.flush()
    i += 1
"""


def test_reading_a_daemons_log_while_it_writes_leaves_the_log_whole(tmp_path: Path) -> None:
    # The daemon's stderr shares the log file's offset with the reader: a reader that moved
    # it made the daemon's next line land over the start of the log.
    t = TargetProcess(tmp_path)
    t.argv = [sys.executable, "-c", CHATTY]
    t.start()
    try:
        for _ in range(3000):
            assert t.log_text().startswith("first line, intact\n")
    finally:
        t.close()
