"""`rpmemfs demo DIR`: a pool in DIR replicated to two local target daemons, mounted at DIR/mnt.

DIR is the demo's own. It is made here (mode 0700) when missing; an existing one is refused
unless it belongs to the user running the demo and nobody else may write to it or to a
directory above it. Otherwise a user who made DIR first (/dev/shm/rpmemfs-demo is anyone's to
make) could plant a symlink that root's demo writes its logs through, or a pool that root's
data lands in. What a previous run left inside (the pool, the targets' directories, logs) must
belong to the same user and be no symlink; logs are never opened through a link.

The targets listen on ports of their choosing the first time; the pool records them, so a later
run starts its targets on the same ports and the pool mounts again. After Ctrl-C the demo
verifies the pool against both replicas while their targets still run, then says what it leaves
on disk (three times the pool's size: the pool and its two replicas).
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import time

from rpmemfs.mountd.provision import create_pool
from rpmemfs.mountinfo import fs_type
from rpmemfs.pmem import PoolMapping
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import inspect_table
from rpmemfs.tools.processes import MountProcess, SpawnError, TargetProcess, run_rpmemfs
from rpmemfs.units import human

POOL_NAME = "demo"  # the replicas' name on their targets
HOST = "127.0.0.1"


class DemoError(SpawnError):
    """The demo will not run in the directory it was given, or cannot start; the message says
    why and what to do."""


def _others_may_write(st: os.stat_result) -> bool:
    return bool(st.st_mode & 0o022)


def _check_ancestors(path: str) -> None:
    """Every directory from / down to ``path`` (resolved) is changed by root or this user
    alone (a sticky one like /tmp or /dev/shm lets nobody else rename what is ours)."""
    me = os.geteuid()
    where = "/"
    for part in [""] + os.path.realpath(path).strip("/").split("/"):
        where = os.path.join(where, part)
        st = os.stat(where)
        if st.st_uid not in (0, me) or (_others_may_write(st) and not st.st_mode & stat.S_ISVTX):
            raise DemoError(f"{where} may be changed by another user (owner uid {st.st_uid}, mode "
                            f"{stat.S_IMODE(st.st_mode):o}): the demo's directory cannot be under "
                            "it; give a DIR elsewhere (under /dev/shm, say)")


def _own(path: str, kind: int) -> bool:
    """Whether ``path`` is there; DemoError unless it is of ``kind`` (stat.S_IFDIR or
    S_IFREG), no symlink, this user's, and nobody else's to change."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    what = "a directory" if kind == stat.S_IFDIR else "a regular file"
    elsewise = "remove it, or give a DIR that does not exist yet (the demo makes it)"
    if stat.S_IFMT(st.st_mode) != kind:
        found = ("a symbolic link, and the demo follows no link" if stat.S_ISLNK(st.st_mode)
                 else f"not {what}")
        raise DemoError(f"{path} is {found}: {elsewise}")
    if st.st_uid != os.geteuid():
        raise DemoError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}), and "
                        f"the demo uses nothing it did not make: {elsewise}")
    if _others_may_write(st):
        raise DemoError(f"{path} may be changed by others (mode {stat.S_IMODE(st.st_mode):o}): "
                        f"{elsewise}")
    if kind == stat.S_IFREG and st.st_nlink != 1:
        raise DemoError(f"{path} has {st.st_nlink} names (hard links), so it may be another "
                        f"file too: {elsewise}")
    return True


def _own_directory(directory: str) -> None:
    """Make DIR (0700), or check the one there is; see the module's text."""
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        _check_ancestors(os.path.dirname(directory))
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            _own(directory, stat.S_IFDIR)
    except OSError as e:
        raise DemoError(f"cannot make {directory}: {e.strerror or e}") from None


def _recorded_replicas(pool: str) -> list[ReplicaSpec]:
    """The replicas a previous run recorded in the pool: two on this host, named demo."""
    with PoolMapping.open(pool, "msync", readonly=True,
                          opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as pm:
        specs = inspect_table(pm.buf).replicas
    if len(specs) != 2 or any(s.name != POOL_NAME or not s.address.startswith(f"{HOST}:")
                              for s in specs):
        raise DemoError(f"{pool} is not a demo pool (its replicas: "
                        f"{', '.join(map(str, specs)) or 'none'}); remove it or give another DIR")
    return specs


def _disk_use(directory: str, skip: str) -> int:
    """Bytes of disk (or memory, on tmpfs) the files under ``directory`` take, ``skip`` (the
    mount point) aside."""
    total = 0
    for top, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if os.path.join(top, d) != skip]
        total += sum(os.lstat(os.path.join(top, f)).st_blocks * 512 for f in files)
    return total


def run_demo(directory: str, size: int) -> int:
    directory = os.path.abspath(directory)
    _own_directory(directory)
    pool = os.path.join(directory, "demo.pool")
    mnt = os.path.join(directory, "mnt")
    made = not _own(pool, stat.S_IFREG)
    recorded = [] if made else _recorded_replicas(pool)
    for i in (1, 2):
        _own(os.path.join(directory, f"target{i}.log"), stat.S_IFREG)
        if not _own(os.path.join(directory, f"target{i}"), stat.S_IFDIR):
            # mode 0700: a target refuses a directory others may change
            os.mkdir(os.path.join(directory, f"target{i}"), 0o700)
    if not _own(mnt, stat.S_IFDIR):
        os.mkdir(mnt, 0o700)
    mode = "force" if fs_type(directory) == "tmpfs" else "auto"
    targets: list[TargetProcess] = []
    # Its output stays on this terminal: the demo is watched there.
    daemon = MountProcess.rpmemfs(pool, mnt, f"pmem={mode}")
    try:
        for i in (1, 2):
            # The first target declares the appliance method (pmem=force on tmpfs), the second
            # serves general-purpose flushes, so the demo shows both (status --json: method).
            opts = {"pmem": "force", "persist": "apm"} if i == 1 and mode == "force" else {}
            listen = recorded[i - 1].address if recorded else f"{HOST}:0"
            t = TargetProcess(os.path.join(directory, f"target{i}"), listen=listen,
                              log_level="warning", log_path=os.path.join(directory, f"target{i}.log"),
                              **opts)
            targets.append(t)
            try:
                t.start()
            except SpawnError as e:
                why = (f" (the port its replica was made on: stop what holds it, or remove "
                       f"{directory} for a new demo)" if recorded else "")
                raise DemoError(f"demo target {i} did not start on {listen}{why}: {e}") from None
        if made:
            specs = [ReplicaSpec.parse(f"{t.address}/{POOL_NAME}") for t in targets]
            create_pool(pool, size, specs)
        try:
            daemon.start()
        except SpawnError as e:
            raise DemoError(f"the demo mount did not come up: {e}") from None
        stop = False

        def _stop(_sig: int, _frame: object) -> None:
            nonlocal stop
            stop = True

        # Before the banner that invites Ctrl-C: one pressed (or sent) as soon as it shows
        # stops the demo cleanly, instead of interrupting it with exit status 130.
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        exe = os.path.join(os.path.dirname(sys.executable), "rpmemfs")
        disk = (f"{human(_disk_use(directory, mnt))} in {directory}: the pool and its two "
                f"replicas, {human(os.path.getsize(pool))} each; they stay after the demo")
        print(f"""
rpmemfs demo is running.
  pool:     {pool} (pmem={mode})
  replicas: {targets[0].address}/{POOL_NAME} (pool in {directory}/target1)
            {targets[1].address}/{POOL_NAME} (pool in {directory}/target2)
  mount:    {mnt}
  disk:     {disk}

Try, in another shell:
  cp -r /usr/share/doc/fuse3 {mnt}/ && sync {mnt}/fuse3/copyright
  python3 -c "import os; f=os.open('{mnt}/x', os.O_CREAT|os.O_WRONLY); os.write(f, b'hi'); os.fsync(f)"
  {exe} status {mnt}     # health, then per replica: state, lag, sent, barriers, last error
  {exe} status {mnt} --json     # all of it, each replica's method and flushes too
  {exe} verify {mnt}     # the pool compared with both replicas, chunk by chunk
Press Ctrl-C here to unmount, verify once more and stop everything.
""", flush=True)
        while not stop and daemon.running:
            time.sleep(0.2)
        code = daemon.returncode if not daemon.running else daemon.unmount(timeout=60)
        if code == 0:
            # Now, while the targets still run: `rpmemfs verify POOL` needs them.
            verified = run_rpmemfs("verify", pool, check=False)
            code = verified.returncode
            print("demo stopped; the pool was unmounted cleanly and compared with both replicas:"
                  "\n  " + (verified.stdout or verified.stderr).strip().replace("\n", "\n  "))
        else:
            print(f"demo stopped; its mount daemon exited with {code}")
        for t in targets:
            t.stop()
        print(f"""Left in {directory}: {human(_disk_use(directory, mnt))} (the pool and its two \
replicas, the targets' logs).
  rm -r {directory}     # frees it
  {exe} demo {directory}     # mounts the pool again
  {exe} check {pool}     # checks the pool offline, now that its targets are gone""")
        return 0 if code == 0 else 1
    finally:
        daemon.stop()
        for t in targets:
            t.close()
