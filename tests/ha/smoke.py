"""Smoke test of the namespaced test cluster: `python -m tests.ha.smoke [--no-fencing]`.

Brings up 3 nodes with a promotable ocf:pacemaker:Stateful clone, then:
  1. kill -9 the promoted node: another one must be promoted (prints the seconds);
  2. restart it: it must come back online (and run an Unpromoted instance);
  3. cut the promoted node's link: with fencing it must be fenced (its netns empty) before
     another node is promoted; without, it must lose quorum and stop its instance while
     another one is promoted;
  4. restart it (fencing) or heal its link (no fencing): all online again;
and tears everything down. Exit status 0 when all of it held.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from tests.ha.cluster import Cluster, ClusterError

CLONE = "st-clone"
STATEFUL_CLONE = """
<clone id="st-clone">
  <meta_attributes id="st-clone-meta">
    <nvpair id="st-clone-promotable" name="promotable" value="true"/>
    <nvpair id="st-clone-pmax" name="promoted-max" value="1"/>
    <nvpair id="st-clone-pnmax" name="promoted-node-max" value="1"/>
  </meta_attributes>
  <primitive id="st" class="ocf" provider="pacemaker" type="Stateful">
    <operations>
      <op id="st-mon-p" name="monitor" interval="2s" timeout="10s" role="Promoted"/>
      <op id="st-mon-u" name="monitor" interval="3s" timeout="10s" role="Unpromoted"/>
    </operations>
  </primitive>
</clone>
"""
POLL = 0.1  # seconds between observations while timing a failover


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.results: list[tuple[str, float]] = []

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.2f}] {msg}", flush=True)

    def record(self, what: str, seconds: float) -> None:
        self.results.append((what, seconds))
        self.log(f"{what}: {seconds:.2f} s")


def other(c: Cluster, *not_these: str) -> str:
    return next(n for n in c.nodes if n not in not_these)


def promoted_elsewhere(c: Cluster, observer: str, old: str) -> str | None:
    p = c.promoted_on(observer, CLONE)
    return p if p is not None and p != old else None


def scenario(c: Cluster, clock: Clock) -> None:
    t = time.monotonic()
    c.up(STATEFUL_CLONE)
    clock.record("up: all online with quorum", time.monotonic() - t)
    p = c.wait(lambda: c.promoted_on(c.nodes[0], CLONE), 60, f"{CLONE} promoted somewhere")
    clock.record(f"up: promoted on {p}", time.monotonic() - t)

    # 1. kill -9 the promoted node
    obs = other(c, p)
    t = time.monotonic()
    c.kill_node(p)
    q = c.wait(lambda: promoted_elsewhere(c, obs, p), 30, f"promotion after killing {p}", POLL)
    clock.record(f"kill {p}: promoted on {q}", time.monotonic() - t)
    if c.fencing and f"off {p} -> rc=0" not in c.fence_log():
        raise ClusterError(f"{p} was killed but not fenced:\n{c.fence_log()}")

    # 2. restart it
    t = time.monotonic()
    c.start_node(p)
    c.wait_online(timeout=60)
    clock.record(f"restart {p}: all online", time.monotonic() - t)
    c.wait(lambda: (c.roles(obs, CLONE) or {}).get(p) == "Unpromoted", 30, f"{p} to run {CLONE} Unpromoted")
    clock.record(f"restart {p}: Unpromoted on {p}", time.monotonic() - t)
    if c.promoted_on(obs, CLONE) != q:
        raise ClusterError(f"the promoted role moved from {q} after {p} rejoined (stickiness)")

    # 3. partition the promoted node
    obs = other(c, q)
    t = time.monotonic()
    c.partition(q)
    if c.fencing:
        seen: dict[str, float] = {}

        def promoted_after_fence() -> str | None:
            if "fenced" not in seen and not c.alive(q):
                seen["fenced"] = time.monotonic() - t
            r = promoted_elsewhere(c, obs, q)
            if r is not None and c.alive(q):
                raise ClusterError(f"{r} promoted while the isolated {q} still runs: no fencing first")
            return r

        r = c.wait(promoted_after_fence, 30, f"promotion after isolating {q}", POLL)
        clock.record(f"partition {q}: promoted on {r}", time.monotonic() - t)
        clock.record(f"partition {q}: fenced (netns empty) by", seen.get("fenced", time.monotonic() - t))
        if f"off {q} -> rc=0" not in c.fence_log():
            raise ClusterError(f"no successful fencing of {q} in the fence log:\n{c.fence_log()}")
        t = time.monotonic()
        c.start_node(q)
    else:
        # Without fencing nothing orders "the isolated node stops" before "the majority
        # promotes": observe both sides in the same polls, and report any overlap.
        events: dict[str, float] = {}
        promoted: list[str] = []
        lost, stopped = f"{q} lost quorum", f"{q} stopped its instance"

        def settled() -> bool:
            now = time.monotonic() - t
            r = promoted_elsewhere(c, obs, q)
            if r is not None and not promoted:
                promoted.append(r)
                events[f"promoted on {r}"] = now
            if lost not in events and c.quorate(q) is False:
                events[lost] = now
            if stopped not in events:
                roles = c.roles(q, CLONE)
                if roles is None:
                    pass  # q cannot tell right now
                elif q not in roles:
                    events[stopped] = now
                elif promoted and roles[q] == "Promoted":
                    events.setdefault("both promoted (split brain) from", now)
            return bool(promoted) and lost in events and stopped in events

        c.wait(settled, 30, f"promotion elsewhere and {q} stopping after isolating it", POLL)
        for what, when in sorted(events.items(), key=lambda kv: kv[1]):
            clock.record(f"partition {q}: {what}", when)
        r = promoted[0]
        if not c.alive(q):
            raise ClusterError(f"{q} died although fencing is off")
        t = time.monotonic()
        c.heal(q)
    c.wait_online(timeout=60)
    clock.record(f"{'restart' if c.fencing else 'heal'} {q}: all online", time.monotonic() - t)
    views = {n: c.promoted_nodes(n, CLONE) for n in c.nodes}
    if any(v != {r} for v in views.values()):
        raise ClusterError(f"after rejoining, the nodes see promoted instances {views}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.ha.smoke", description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="/tmp/rpmemfs-ha-smoke", help="state and logs (on disk)")
    ap.add_argument("--no-fencing", action="store_true")
    ap.add_argument("--token-ms", type=int, default=1000)
    args = ap.parse_args(argv)
    clock = Clock()
    c = Cluster(args.base, fencing=not args.no_fencing, token_ms=args.token_ms)
    clock.log(f"base {c.base}, nodes {' '.join(c.nodes)}, fencing {'on' if c.fencing else 'off'}")
    failed: BaseException | None = None
    t = time.monotonic()
    try:
        with c:
            try:
                scenario(c, clock)
                t = time.monotonic()
            except ClusterError:
                for n in c.nodes:
                    print(f"----- {n} (alive: {c.alive(n)})\n{c.log_tail(n, 15)}", file=sys.stderr)
                print(f"----- fence log\n{c.fence_log()}", file=sys.stderr)
                raise
    except ClusterError as e:
        failed = e
    teardown = time.monotonic() - t
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    ours = [line.split()[0] for line in left.splitlines() if line.split()[0] in (*c.nodes, c.bridge_netns)]
    clock.log(f"torn down; namespaces of ours left: {ours or 'none'} (down() took {teardown:.2f} s)")
    print("summary: " + ", ".join(f"{w} {s:.2f}" for w, s in clock.results))
    if failed is not None or ours:
        print(f"FAILED: {failed or ours}", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
