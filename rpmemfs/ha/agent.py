"""The agent's actions (`rpmemfs ha ACTION`, run by mount/ocf/rpmemfs for Pacemaker).

States, as Pacemaker sees them:
- stopped: neither this node's target daemon nor the mount runs;
- started (unpromoted): the target daemon serves this node's copy;
- promoted: the copy is mounted as the primary, and the target daemon does not run (the
  copy is the mount's now, and nothing else may write it).
monitor maps the mount's health (`rpmemfs status`: healthy, degraded, failing, unknown) onto
RUNNING_PROMOTED, RUNNING_PROMOTED, FAILED_PROMOTED and ERR_GENERIC: degraded still
acknowledges fsyncs; failing (fenced, or fewer than min_replicas in sync) does not, and
Pacemaker recovers it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping

from rpmemfs.ha import primary, target_daemon
from rpmemfs.ha.config import HaConfig, check_installed, load
from rpmemfs.ha.ocf import ACTIONS, Ocf, OcfError, metadata
from rpmemfs.ha.promote import promote
from rpmemfs.ha.survey import Survey, local_copy
from rpmemfs.mountd.status import Health

USAGE = "usage: rpmemfs ha {start|stop|monitor|promote|demote|notify|validate-all|meta-data}"
# A node whose copy is usable is preferred; one without can still be promoted (the copy
# comes from another node), so that a node rebuilt empty does not keep the pool down.
SCORE_COPY = 100
SCORE_NO_COPY = 10


def _deadline(action: str, env: Mapping[str, str]) -> float:
    default = next((t for name, t, _, _ in ACTIONS if name == action), 30)
    try:
        seconds = int(env.get("OCF_RESKEY_CRM_meta_timeout", "")) / 1000
    except ValueError:
        seconds = default
    # Answer before Pacemaker gives up on the action, which it would count as a failure.
    return time.monotonic() + max(2.0, seconds - 2.0)


def _set_score(cfg: HaConfig) -> None:
    found = Survey()
    local_copy(cfg, found)
    score = SCORE_COPY if found.copies else SCORE_NO_COPY
    memo = os.path.join(cfg.state_dir, "score")
    try:
        with open(memo) as f:
            if f.read().strip() == str(score):
                return
    except OSError:
        pass
    try:
        done = subprocess.run(["crm_attribute", "--promotion", "-v", str(score)],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return  # no cluster (ocf-tester, a manual run): nothing to tell
    if done.returncode == 0:
        with open(memo, "w") as f:
            f.write(f"{score}\n")


def _clear_score(cfg: HaConfig) -> None:
    try:
        os.unlink(os.path.join(cfg.state_dir, "score"))
    except FileNotFoundError:
        pass
    try:
        subprocess.run(["crm_attribute", "--promotion", "-D"], capture_output=True, timeout=10,
                       check=False)
    except (OSError, subprocess.TimeoutExpired):
        pass


def monitor(cfg: HaConfig) -> Ocf:
    found = primary.mount_health(cfg)
    if found is not None:
        h, why = found
        if h in (Health.HEALTHY, Health.DEGRADED):
            # The primary's copy is as good as any: without its score kept up, a replica's
            # higher one would make Pacemaker move the promoted role for nothing.
            _set_score(cfg)
            return Ocf.RUNNING_PROMOTED
        print(f"rpmemfs agent: {cfg.directory}: {why}", file=sys.stderr)
        return Ocf.FAILED_PROMOTED if h is Health.FAILING else Ocf.ERR_GENERIC
    if target_daemon.running(cfg) is None:
        return Ocf.NOT_RUNNING
    _set_score(cfg)
    return Ocf.SUCCESS


def start(cfg: HaConfig, deadline: float) -> Ocf:
    check_installed(cfg)
    if primary.mounted(cfg):
        return Ocf.SUCCESS  # promoted already: Pacemaker's next monitor says so
    target_daemon.start(cfg, deadline)
    _set_score(cfg)
    return Ocf.SUCCESS


def stop(cfg: HaConfig, deadline: float) -> Ocf:
    primary.unmount(cfg, deadline)
    target_daemon.stop(cfg, deadline)
    _clear_score(cfg)
    return Ocf.SUCCESS


def demote(cfg: HaConfig, deadline: float) -> Ocf:
    primary.unmount(cfg, deadline)
    target_daemon.start(cfg, deadline)
    _set_score(cfg)
    return Ocf.SUCCESS


def _run(action: str, env: Mapping[str, str]) -> Ocf:
    if action == "meta-data":
        print(metadata(), end="")
        return Ocf.SUCCESS
    if action in ("usage", "help"):
        print(USAGE)
        return Ocf.SUCCESS
    if action not in ("start", "stop", "monitor", "promote", "demote", "notify", "validate-all"):
        print(USAGE, file=sys.stderr)
        return Ocf.ERR_UNIMPLEMENTED
    try:
        cfg = load(env)
    except OcfError as e:
        if action == "stop":
            # Nothing this configuration could have started can be found; a failed stop
            # would get the node fenced for a typo.
            print(f"rpmemfs agent: stop: {e}", file=sys.stderr)
            return Ocf.SUCCESS
        raise
    deadline = _deadline(action, env)
    if action == "validate-all":
        check_installed(cfg)
        return Ocf.SUCCESS
    if action == "notify":
        return Ocf.SUCCESS
    if action == "monitor":
        return monitor(cfg)
    if action == "start":
        return start(cfg, deadline)
    if action == "stop":
        return stop(cfg, deadline)
    if action == "demote":
        return demote(cfg, deadline)
    now = monitor(cfg)
    if now is Ocf.RUNNING_PROMOTED:
        return Ocf.SUCCESS
    if now in (Ocf.FAILED_PROMOTED, Ocf.ERR_GENERIC):
        raise OcfError(Ocf.ERR_GENERIC, f"{cfg.directory} is mounted but does not serve; "
                       "Pacemaker recovers it (demote, stop, start)")
    check_installed(cfg)
    print(f"rpmemfs agent: {promote(cfg, deadline)}", file=sys.stderr)
    _set_score(cfg)
    return Ocf.SUCCESS


def main(action: str, env: Mapping[str, str] | None = None) -> int:
    try:
        return int(_run(action, os.environ if env is None else env))
    except OcfError as e:
        print(f"rpmemfs agent: {action}: {e}", file=sys.stderr)
        return int(e.code)
