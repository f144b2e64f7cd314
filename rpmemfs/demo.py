"""`rpmemfs demo DIR`: a pool in DIR mounted at DIR/mnt, until Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rpmemfs.fs.mkfs import mkfs
from rpmemfs.units import parse_size


def _on_tmpfs(path: str) -> bool:
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, typ
    return fstype == "tmpfs"


def run_demo(directory: str, size: str) -> int:
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    pool = os.path.join(directory, "demo.pool")
    mnt = os.path.join(directory, "mnt")
    os.makedirs(mnt, exist_ok=True)
    if not os.path.exists(pool):
        mkfs(pool, parse_size(size))
    mode = "force" if _on_tmpfs(directory) else "auto"
    cmd = [sys.executable, "-m", "rpmemfs.cli", "mount", pool, mnt, "-f", "-o", f"pmem={mode}"]
    daemon = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt):
        if daemon.poll() is not None or time.monotonic() > deadline:
            sys.stderr.write("rpmemfs: the demo mount did not come up\n")
            daemon.kill()
            return 1
        time.sleep(0.05)
    print(f"""
rpmemfs demo is running.
  pool:   {pool} (pmem={mode})
  mount:  {mnt}

Try, in another shell:
  cp -r /usr/share/doc/fuse3 {mnt}/ && ls -l {mnt}/fuse3
  python3 -c "import os; f=os.open('{mnt}/x', os.O_CREAT|os.O_WRONLY); os.write(f, b'hi'); os.fsync(f)"
  rpmemfs status {mnt}
Press Ctrl-C here to unmount and stop (the pool stays; run the demo again to remount it).
""", flush=True)
    stop = False

    def _stop(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    while not stop and daemon.poll() is None:
        time.sleep(0.2)
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
    print("demo stopped; pool unmounted cleanly" if daemon.returncode == 0 else
          f"mount daemon exited with {daemon.returncode}")
    return 0 if daemon.returncode == 0 else 1
