"""`rpmemfs demo DIR`: a pool in DIR replicated to two local target daemons, mounted at DIR/mnt."""

from __future__ import annotations

import os
import signal
import sys
import time

from rpmemfs.mountd.provision import create_pool
from rpmemfs.mountinfo import fs_type
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.tools.processes import MountProcess, SpawnError, TargetProcess
from rpmemfs.units import parse_size


def run_demo(directory: str, size: str) -> int:
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    pool = os.path.join(directory, "demo.pool")
    mnt = os.path.join(directory, "mnt")
    os.makedirs(mnt, exist_ok=True)
    mode = "force" if fs_type(directory) == "tmpfs" else "auto"
    targets: list[TargetProcess] = []
    # Its output stays on this terminal: the demo is watched there.
    daemon = MountProcess.rpmemfs(pool, mnt, f"pmem={mode}")
    try:
        for i in (1, 2):
            tdir = os.path.join(directory, f"target{i}")
            os.makedirs(tdir, mode=0o700, exist_ok=True)  # a target refuses a directory others may change
            # The first target declares the appliance method (pmem=force on tmpfs), the second
            # serves general-purpose flushes, so the demo shows both.
            opts = {"pmem": "force", "persist": "apm"} if i == 1 and mode == "force" else {}
            t = TargetProcess(tdir, listen=f"127.0.0.1:{7420 + i}", log_level="warning",
                              log_path=os.path.join(directory, f"target{i}.log"), **opts)
            targets.append(t)
            try:
                t.start()
            except SpawnError as e:
                raise SpawnError(f"demo target {i} did not start: {e}") from None
        if not os.path.exists(pool):
            specs = [ReplicaSpec.parse(f"{t.address}/demo") for t in targets]
            create_pool(pool, parse_size(size), specs)
        try:
            daemon.start()
        except SpawnError as e:
            raise SpawnError(f"the demo mount did not come up: {e}") from None
        exe = os.path.join(os.path.dirname(sys.executable), "rpmemfs")
        print(f"""
rpmemfs demo is running.
  pool:     {pool} (pmem={mode})
  replicas: {targets[0].address}/demo (pool in {directory}/target1)
            {targets[1].address}/demo (pool in {directory}/target2)
  mount:    {mnt}

Try, in another shell:
  cp -r /usr/share/doc/fuse3 {mnt}/ && sync {mnt}/fuse3/copyright
  python3 -c "import os; f=os.open('{mnt}/x', os.O_CREAT|os.O_WRONLY); os.write(f, b'hi'); os.fsync(f)"
  {exe} status {mnt}     # replicas, their method, barriers and flushes
Press Ctrl-C here to unmount and stop everything (the pools stay; run the demo again to remount).
Afterwards `{exe} verify {pool}` compares the pool with both replicas, chunk by chunk (cmp
would show them differ only at the end: the local pool's sync map, its own record of what each
replica misses, is not replicated).
""", flush=True)
        stop = False

        def _stop(_sig: int, _frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        while not stop and daemon.running:
            time.sleep(0.2)
        code = daemon.returncode if not daemon.running else daemon.unmount(timeout=60)
        print("demo stopped; pool unmounted cleanly" if code == 0 else
              f"mount daemon exited with {code}")
        return 0 if code == 0 else 1
    finally:
        daemon.stop()
        for t in targets:
            t.close()
