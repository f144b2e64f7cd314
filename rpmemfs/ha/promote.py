"""Promote: this node's copy becomes the primary, replicated to every other node.

1. Stop this node's target daemon: from here nothing but this promote and the mount writes
   this node's copy (and the old primary's session on it ends).
2. Survey every copy (survey.py) and choose one (election.py): the most recent of a majority,
   or refuse.
3. Fence, then bring this node's copy to the chosen one:
   - the chosen copy is this node's: claim every reachable replica as a takeover, with an
     epoch above all seen (admin/promote.py, takeover_in_place); nothing is copied;
   - it is another node's: `rpmemfs promote` from it (claims, copies only what differs,
     checks); the source is in sync from then on;
   - no node has one and every node answered: make the pool (the first start).
4. The replica table becomes every other node (the old primary's table named this node and
   not the old primary); replicas not known to be equal are compared in full at the mount.
5. Mount, and wait until an fsync would succeed: promoted means serving.

The old primary, if it comes back, finds its replicas claimed above its epoch (its mount is
refused, a running one is fenced); as a target it is claimed by the new primary, compared in
full and resynced: it rejoins as a replica.
"""

from __future__ import annotations

import time

import trio

from rpmemfs.admin.errors import RepairError
from rpmemfs.admin.promote import promote_pool, takeover_in_place
from rpmemfs.ha import primary, target_daemon
from rpmemfs.ha.config import HaConfig
from rpmemfs.ha.election import choose
from rpmemfs.ha.ocf import Ocf, OcfError
from rpmemfs.ha.survey import partition_members, survey
from rpmemfs.mountd.errors import ProvisionError
from rpmemfs.mountd.provision import create_pool
from rpmemfs.transport.tokens import TokenError, chosen_token


def token(cfg: HaConfig) -> bytes:
    try:
        found = chosen_token(cfg.token_file, None)
    except (TokenError, OSError) as e:
        raise OcfError(Ocf.ERR_INSTALLED, f"token_file {cfg.token_file}: {e}") from None
    assert found is not None
    return found


def _take_copy(cfg: HaConfig, tok: bytes) -> str:
    """Steps 2-4; what was done, in words."""
    found = trio.run(survey, cfg, tok, partition_members())
    chosen = choose(found, len(cfg.nodes), cfg.majority)
    peers = [cfg.spec(n) for n in cfg.others]
    # A node the survey did not reach is not waited for again (a dead node's address
    # answers nothing: each wait is a whole timeout); it is fenced when it comes back.
    unreached = {str(cfg.spec(n)): f"{n.name}: {found.unreached[n.name]}"
                 for n in cfg.others if n.name in found.unreached}
    # The old primary's table names this node, whose target the promote stopped.
    unreached[str(cfg.spec(cfg.mine))] = "this node: its copy is the one promoted"
    wp, timeout = cfg.wire_protection, cfg.probe_timeout
    if chosen is None:
        if cfg.size is None:
            raise OcfError(Ocf.ERR_CONFIGURED, "no node holds a copy of the pool yet: set size= "
                           "to make it at the first promote, or make it by hand (docs/ha.md)")
        create_pool(cfg.pool_path, cfg.size, peers, token=tok, token_file=cfg.token_file,
                    wire_protection=wp)
        on = ", ".join(n.name for n in cfg.others) or "no other node"
        return f"made the pool ({cfg.size} bytes), its replicas on {on}"
    if chosen.local:
        done = trio.run(lambda: takeover_in_place(cfg.pool_path, peers, tok, token_file=cfg.token_file,
                                                  timeout=timeout, wire_protection=wp,
                                                  unreached=unreached))
        how = "this node's copy, the most recent"
    else:
        source = cfg.spec(next(n for n in cfg.nodes if n.name == chosen.node))
        done = trio.run(lambda: promote_pool(cfg.pool_path, source, tok, force=True, timeout=timeout,
                                             wire_protection=wp, unreached=unreached,
                                             replicas=(peers, cfg.token_file)))
        how = f"{chosen.node}'s copy, the most recent ({done['bytes_copied']} bytes copied)"
    mine = str(cfg.spec(cfg.mine))  # named in the old primary's table; this promote stopped it
    missed = ", ".join(r for r in done["unreachable"] if r != mine) or "none"
    return (f"promoted {how} at epoch {done['epoch']} ({found.describe()}); replicas not reached "
            f"(fenced when they come back): {missed}")


def promote(cfg: HaConfig, deadline: float) -> str:
    tok = token(cfg)
    target_daemon.stop(cfg, deadline)
    try:
        what = _take_copy(cfg, tok)
        primary.mount(cfg, deadline)
    except BaseException as e:
        # Left unpromoted, as a failed promote must: serving its copy again, if it can.
        if not primary.mounted(cfg):
            try:
                target_daemon.start(cfg, time.monotonic() + 10)
            except OcfError:
                pass
        if isinstance(e, (RepairError, ProvisionError)):
            raise OcfError(Ocf.ERR_GENERIC, str(e)) from None
        raise
    health = primary.wait_writable(cfg, deadline - 1)
    return f"{what}; mounted at {cfg.directory}, {health.name.lower()}"
