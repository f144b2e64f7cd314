"""Automatic failover on a real three-node Pacemaker cluster: `python -m tests.ha.failover`
(scripts/test-ha.sh runs it).

Three nodes on this machine (tests/ha/cluster.py: each its own network, mount and UTS
namespace, real corosync and pacemaker, a fence agent that kills a node's namespace), with
the pool as an ocf:rpmemfs:rpmemfs promotable clone (mount/ocf/rpmemfs, as docs/ha.md sets it
up). A writer on the primary's mount fsyncs 64-byte records and prints each acknowledged one;
this process logs them, outside the cluster. Then, round after round, alternately:

- kill: every process of the primary node killed and its link cut;
- partition: its link cut, its processes alive (the majority fences it);

and each time: another node must be promoted; the writer, started again on the new mount
from the record after the last acknowledged one, must be acknowledged again (the failover
time: from the failure to that first acknowledgement); the old node, restarted, must rejoin as
a replica (every replica in sync), `rpmemfs verify` must be clean, every acknowledged record
must be in the pool, and at no moment may two nodes be promoted, nor may the cut-off node
acknowledge anything after the new primary did.

The last line: `failovers: N, acked lost: L, max failover seconds: S`; exit status 0 when N
rounds ran, nothing acknowledged was lost, no split brain was seen and S is within the goal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from tests.ha.cluster import Cluster, ClusterError

REPO = Path(__file__).resolve().parents[2]
RPMEMFS = REPO / ".venv" / "bin" / "rpmemfs"
PYTHON = REPO / ".venv" / "bin" / "python"
WRITER = REPO / "tests" / "ha" / "writer.py"
CLONE = "app-clone"
POOL_DIR = "/run/rpmemfs-pools"  # in each node: bound to its own directory on the host
MNT = "/run/rpmemfs-mnt/app"  # in each node's private /run
GOAL_SECONDS = 15.0


def resources(nodes: str, token: Path) -> str:
    params = {"pool": "app", "directory": MNT, "nodes": nodes, "pool_dir": POOL_DIR, "size": "64M",
              "token_file": str(token), "mount_options": "pmem=msync", "rpmemfs": str(RPMEMFS)}
    attrs = "\n".join(f'        <nvpair id="app-{k}" name="{k}" value="{v}"/>' for k, v in params.items())
    ops = [("start", "60s", "0s", ""), ("stop", "60s", "0s", ""), ("promote", "90s", "0s", ""),
           ("demote", "60s", "0s", ""), ("monitor", "30s", "5s", "Promoted"),
           ("monitor", "30s", "7s", "Unpromoted")]
    op_xml = "\n".join(
        f'        <op id="app-{name}-{interval}" name="{name}" timeout="{timeout}" interval="{interval}"'
        + (f' role="{role}"' if role else "") + "/>" for name, timeout, interval, role in ops)
    return f"""
<clone id="{CLONE}">
  <meta_attributes id="app-clone-meta">
    <nvpair id="app-clone-promotable" name="promotable" value="true"/>
    <nvpair id="app-clone-pmax" name="promoted-max" value="1"/>
    <nvpair id="app-clone-pnmax" name="promoted-node-max" value="1"/>
    <nvpair id="app-clone-cnmax" name="clone-node-max" value="1"/>
  </meta_attributes>
  <primitive id="app" class="ocf" provider="rpmemfs" type="rpmemfs">
    <instance_attributes id="app-ia">
{attrs}
    </instance_attributes>
    <operations>
{op_xml}
    </operations>
  </primitive>
</clone>
"""


class Writer:
    """A writer process in a node's mount namespace (not its netns: it outlives the node's
    kill and sees the mount die instead), its acknowledgements read into this process."""

    def __init__(self, c: Cluster, node: str, first: int, log: IO[str]) -> None:
        self.node = node
        self.acked: list[tuple[int, float]] = []
        self.error: str | None = None
        self.proc = c.popen(node, [str(PYTHON), str(WRITER), MNT, str(first)], netns=False,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._log = log
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word = line.split()
            if word and word[0] == "E":
                self.error = line.strip()
            elif len(word) == 2 and word[0].isdigit():
                self.acked.append((int(word[0]), float(word[1])))
                self._log.write(f"{self.node} {word[0]} {word[1]}\n")
            else:
                self.error = (self.error or "") + line

    def stop(self, timeout: float = 30.0) -> None:
        """Wait for it to end (it ends at its first error), killing it past ``timeout``."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._thread.join(5)


class Run:
    def __init__(self, c: Cluster, base: Path) -> None:
        self.c = c
        self.base = base
        self.log = open(base / "acked.log", "a", buffering=1)  # noqa: SIM115
        self.acked: set[int] = set()
        self.writer: Writer | None = None
        self.failover_seconds: list[float] = []
        self.split_brain: list[str] = []
        self.t0 = time.monotonic()

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.2f}] {msg}", flush=True)

    def observer(self, *not_these: str) -> str:
        return next(n for n in self.c.nodes if n not in not_these and self.c.alive(n))

    def promoted(self, observer: str) -> str | None:
        found = self.c.promoted_nodes(observer, CLONE)
        if len(found) > 1:
            self.split_brain.append(f"{observer} sees {sorted(found)} promoted")
        return next(iter(sorted(found)), None)

    def start_writer(self, node: str) -> Writer:
        first = max(self.acked, default=-1) + 1
        self.writer = Writer(self.c, node, first, self.log)
        return self.writer

    def collect(self, w: Writer) -> None:
        self.acked.update(i for i, _ in w.acked)

    def rejoined(self, primary: str) -> bool:
        st = self.c.run(primary, [str(RPMEMFS), "status", MNT, "--json"], check=False)
        if st.returncode not in (0, 1):
            return False
        import json

        doc: dict[str, Any] = json.loads(st.stdout)
        return len(doc["replicas"]) == 2 and all(r["state"] == "in-sync" for r in doc["replicas"])

    def check_pool(self, primary: str) -> int:
        """rpmemfs verify clean, and the acknowledged records in the pool: how many are not."""
        v = self.c.run(primary, [str(RPMEMFS), "verify", MNT], timeout=120, check=False)
        if v.returncode != 0 or v.stdout.count("identical") != 2:
            raise ClusterError(f"verify on {primary}: exit {v.returncode}\n{v.stdout}{v.stderr}")
        listing = self.base / "acked.txt"
        listing.write_text("".join(f"{i}\n" for i in sorted(self.acked)))
        r = self.c.run(primary, [str(PYTHON), str(WRITER), "--check", MNT, str(listing)], timeout=60)
        lost, *examples = r.stdout.split()
        if int(lost):
            self.say(f"LOST {lost} acknowledged records, e.g. {examples}")
        return int(lost)

    def round(self, k: int, mode: str) -> int:
        c = self.c
        old = self.promoted(self.observer())
        assert old is not None and self.writer is not None and self.writer.node == old
        time.sleep(2.0)  # records acknowledged on the old primary
        w = self.writer
        self.say(f"round {k}: {mode} {old} ({len(w.acked)} records acknowledged there so far)")
        t_fail = time.monotonic()
        if mode == "kill":
            c.kill_node(old)
        else:
            c.partition(old)
        survivor = self.observer(old)

        def new_primary() -> str | None:
            p = self.promoted(survivor)
            return p if p is not None and p != old else None

        new = c.wait(new_primary, 60, f"a node other than {old} promoted", interval=0.1)
        self.say(f"  {new} promoted after {time.monotonic() - t_fail:.2f} s")
        w.stop()  # it ends at the old mount's first error (ENOTCONN, or EIO when fenced)
        self.collect(w)
        late = [i for i, t in w.acked if t > t_fail]
        nw = self.start_writer(new)
        c.wait(lambda: nw.acked or nw.error, 60, f"the writer's first acknowledgement on {new}",
               interval=0.05)
        if nw.error:
            raise ClusterError(f"the writer on {new} failed: {nw.error}")
        first_ack = nw.acked[0][1]
        seconds = first_ack - t_fail
        self.failover_seconds.append(seconds)
        self.say(f"  first acknowledged fsync on {new} {seconds:.2f} s after the {mode}; "
                 f"{len(late)} acknowledged on {old} after it")
        if mode == "partition" and any(t >= first_ack for _, t in w.acked):
            self.split_brain.append(f"round {k}: {old} acknowledged after {new} did")
        # The old node comes back (fenced: its namespace is empty) and rejoins as a replica.
        if c.alive(old):
            c.heal(old)
        else:
            c.start_node(old, timeout=60)
        c.wait(lambda: (c.roles(new, CLONE) or {}).get(old) == "Unpromoted", 90,
               f"{old} running unpromoted")
        c.wait(lambda: self.rejoined(new), 90, f"{old} in sync with {new}")
        self.say(f"  {old} rejoined as a replica, in sync")
        # Checked with the writer stopped: a live verify under a writer that never pauses
        # sees the chunk it writes differ at every round (docs/ha.md, "The test").
        nw.proc.kill()
        nw.stop()
        self.collect(nw)
        lost = self.check_pool(new)
        self.start_writer(new)
        return lost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--base", default="/var/tmp/rpmemfs-ha")
    ap.add_argument("--no-fencing", action="store_true")
    args = ap.parse_args()
    base = Path(args.base)
    data = Path("/dev/shm/rpmemfs-ha")  # the nodes' copies (bound into each node), kept apart
    shutil.rmtree(data, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    for n in ("n1", "n2", "n3"):
        (data / n / "pools").mkdir(parents=True, mode=0o700)
        os.chmod(data / n / "pools", 0o700)
    agent_dir = base / "ocf"
    shutil.rmtree(agent_dir, ignore_errors=True)
    agent_dir.mkdir()
    shutil.copy2(REPO / "mount" / "ocf" / "rpmemfs", agent_dir / "rpmemfs")
    token = base / "token"
    token.unlink(missing_ok=True)
    subprocess.run([str(RPMEMFS), "token", "new", str(token)], check=True, capture_output=True)
    nodes = " ".join(f"n{i}=10.77.0.{i}:7420" for i in (1, 2, 3))
    lost = 0
    run: Run | None = None
    with Cluster(base / "cluster", fencing=not args.no_fencing,
                 extra_binds=[(f"{data}/{{node}}/pools", POOL_DIR)],
                 overlays=[(str(agent_dir), "/usr/lib/ocf/resource.d/rpmemfs")]) as c:
        run = Run(c, base)
        try:
            c.up(resources(nodes, token))
            first = c.wait(lambda: run.promoted("n1"), 90, "the pool promoted somewhere")
            run.say(f"cluster up, pool made and promoted on {first}")
            run.start_writer(first)
            for k in range(1, args.rounds + 1):
                lost += run.round(k, "kill" if k % 2 else "partition")
        except BaseException:
            for n in c.nodes:
                if c.alive(n):
                    print(c.log_tail(n, 30), file=sys.stderr)
            raise
        finally:
            if run.writer is not None:
                run.writer.proc.kill()
    rounds = len(run.failover_seconds)
    worst = max(run.failover_seconds, default=0.0)
    for s in run.split_brain:
        print(f"SPLIT BRAIN: {s}")
    print(f"failovers: {rounds}, acked lost: {lost}, max failover seconds: {worst:.2f}")
    ok = rounds == args.rounds and lost == 0 and not run.split_brain and worst <= GOAL_SECONDS
    if ok:
        shutil.rmtree(data, ignore_errors=True)  # the copies (192 MiB of memory); kept on a failure
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
